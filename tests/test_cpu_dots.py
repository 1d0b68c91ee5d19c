"""`train.cpu_dots`: which library runs the learner's float products on XLA:CPU
(`runtime.xla_cpu`): 'auto' picks by the CPU's vector width, 'learner' compiles only the
learner's update and log-prob programs without YNNPACK's fusions, and their values are XLA's
own choice's up to float rounding."""

import jax
import numpy as np
import pytest

from qurl_jax.learner.learner import Learner, OptimConfig
from qurl_jax.models import init_params
from qurl_jax.parallel import sharding as shd
from qurl_jax.rl.objectives import ObjectiveConfig
from qurl_jax.runtime import xla_cpu
from tests.test_prox import CFG, _batch

_FLAG = "xla_cpu_experimental_ynn_fusion_type"


@pytest.mark.parametrize("avx512,auto", [(True, "xla"), (False, "learner")])
def test_auto_picks_by_the_cpu(monkeypatch, avx512, auto) -> None:
    monkeypatch.setattr(xla_cpu, "has_avx512", lambda: avx512)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    assert xla_cpu.resolve("auto") == auto
    assert ("no AVX512" in xla_cpu.describe("auto")) == (not avx512)
    for choice in xla_cpu.CPU_DOTS:  # only 'eigen' sets anything process-wide
        assert xla_cpu.xla_flags(choice) == (f"--{_FLAG}=" if choice == "eigen" else "")
    want = {_FLAG: ""}
    assert xla_cpu.learner_compiler_options("auto") == (None if avx512 else want)
    assert xla_cpu.learner_compiler_options("learner") == want
    assert xla_cpu.learner_compiler_options("xla") is None
    assert xla_cpu.learner_compiler_options("eigen") is None  # the process's flag already
    monkeypatch.setenv("XLA_FLAGS", f"--{_FLAG}=dot")  # a user's own setting wins
    assert xla_cpu.learner_compiler_options("learner") is None
    assert "XLA_FLAGS" in xla_cpu.describe("learner")  # the log says which setting runs
    with pytest.raises(ValueError, match="cpu_dots"):
        xla_cpu.resolve("mkl")
    with pytest.raises(ValueError, match="cpu_dots"):
        Learner(CFG, ObjectiveConfig(), OptimConfig(), shd.make_mesh(), cpu_dots="mkl")


def test_learner_programs_take_eigen_with_the_same_values(monkeypatch) -> None:
    """'learner': the compiled update and log-prob programs hold no YNNPACK fusion (XLA's choice
    does), and their log-probs, gradients and the update's metrics equal XLA's choice's."""
    monkeypatch.delenv("XLA_FLAGS", raising=False)  # the suite's flags do not set the option
    mesh = shd.make_mesh()
    learners = {c: Learner(CFG, ObjectiveConfig(), OptimConfig(learning_rate=1e-2), mesh,
                           temperature=0.9, cpu_dots=c) for c in ("xla", "learner")}
    assert learners["xla"].compiler_options is None
    assert learners["learner"].compiler_options == {_FLAG: ""}
    params0 = init_params(CFG, jax.random.key(0))
    batch = _batch(learners["xla"].shard_params(params0))
    out = {}
    for choice, learner in learners.items():
        params = learner.shard_params(params0)
        opt = learner.init_opt_state(params)
        update = learner.update_fn(params, opt, batch).lower(params, opt, batch, None).compile()
        logp_fn = learner.logprobs_fn(params, batch).lower(params, batch, None).compile()
        for program in (update, logp_fn):
            assert ("ynn_fusion" in program.as_text()) == (choice == "xla"), choice
        # The update's gradients, compiled with the learner's own options (AdamW's first step
        # moves a weight by the learning rate's size whatever its gradient, so the updated
        # weights say little about rounding).
        grads = jax.jit(jax.grad(lambda p, b, loss=learner.loss: loss(p, b)[0]),
                        compiler_options=learner.compiler_options)(params, batch)
        new_params, _, metrics = learner.update(params, opt, batch)
        out[choice] = (learner.logprobs(new_params, batch), grads, metrics)
    (logp_x, grads_x, metrics_x), (logp_e, grads_e, metrics_e) = out["xla"], out["learner"]
    np.testing.assert_allclose(logp_e, logp_x, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(grads_x), jax.tree.leaves(grads_e), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)
    for k, v in metrics_x.items():
        np.testing.assert_allclose(metrics_e[k], v, rtol=1e-4, atol=1e-6, err_msg=k)
    assert float(metrics_x["update/grad_norm"]) > 0


def test_bench_compares_the_two_in_one_run(capsys) -> None:
    """`bench.learner --cpu_dots_ab`: the same packed batch through both choices, a ratio out;
    'eigen' (a process-wide flag) is refused there."""
    import json

    from qurl_jax.bench import learner as bench

    bench.main(["--cpu_dots_ab", "--rows=4", "--max_prompt_len=16", "--max_new_tokens=16",
                "--rounds=1", "--hidden=32", "--heads=2", "--vocab=64"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["xla/seconds"] > 0 and out["learner/seconds"] > 0
    assert out["speedup"] == pytest.approx(out["xla/seconds"] / out["learner/seconds"])
    assert out["xla/real_token_share"] == out["learner/real_token_share"] <= 1.0
    with pytest.raises(SystemExit):
        bench.main(["--cpu_dots=eigen"])
    assert "--cpu_dots=eigen needs --vs_torch" in capsys.readouterr().err
