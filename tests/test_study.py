"""`python -m qurl_jax.study --quick`: two variants from one shared warm start, their table and
figures, and a rerun that finds every run finished and runs nothing again."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _study(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1",
               PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "qurl_jax.study.runner", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=600, env=env)


@pytest.mark.slow  # ~2 min; CI runs it on its own (.ci/run), beside the embedded default
def test_quick_study_runs_two_variants_and_resumes(tmp_path):
    out = tmp_path / "study"
    proc = _study("--config=configs/chain_tiny.py", f"--out={out}", "--quick")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("[study] start") == 2
    result = json.loads((out / "study.json").read_text())
    assert result["failed"] == [] and result["steps"] == 2
    assert set(result["variants"]) == {"fp", "int8_acr"}
    # Both runs loaded the one warm start, which only the first run evaluated (at step 0).
    assert set(result["before"]) >= {"eval/chain/greedy_acc", "eval/chain_carry10/greedy_acc"}
    assert (out / "warm_start" / "sft_model" / "config.json").is_file()
    for name in ("fp_s0", "int8_acr_s0"):
        rows = [json.loads(line) for line in (out / "runs" / name / "metrics.jsonl").open()]
        assert max(r["step"] for r in rows) == 2
        assert any("eval/chain/greedy_acc" in r and r["step"] == 0 for r in rows) == (
            name == "fp_s0")
        assert "--config.model.source=hf" in " ".join(
            json.loads((out / "runs" / name / "study_done.json").read_text())["command"])
    fp = result["variants"]["fp"]["runs"]["fp_s0"]
    int8 = result["variants"]["int8_acr"]["runs"]["int8_acr_s0"]
    assert int8["kl_behav_prox_k3"] > 0 and int8["kl_behav_prox_k3"] > 10 * abs(
        fp["kl_behav_prox_k3"])  # the quantized actor is off-policy, the fp one is not
    assert "quant/code_change_fraction" in int8 and "quant/code_change_fraction" not in fp
    table = (out / "study.md").read_text()
    for row in ("| warm start (before RL) |", "| fp rollout (reference) * | 1 |",
                "| int8 rollout, ACR (s = 1) * | 1 |"):
        assert row in table
    for png in ("study.png", "quantized.png"):
        assert (out / "plots" / png).stat().st_size > 10_000

    again = _study("--config=configs/chain_tiny.py", f"--out={out}", "--quick")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "[study] start" not in again.stdout
    assert (out / "study.md").read_text().split("\n", 3)[3] == table.split("\n", 3)[3]
    # Finished runs are reused only for the same command; other settings stop the study.
    other = _study("--config=configs/chain_tiny.py", f"--out={out}", "--quick", "--steps=5",
                   "--variants=fp")
    assert other.returncode == 0, other.stderr[-3000:]  # --quick keeps its own 2 steps
    # The same config file named by its absolute path (as --rows names it) is the same command.
    same = _study(f"--config={REPO}/configs/chain_tiny.py", f"--out={out}", "--quick")
    assert same.returncode == 0 and "[study] start" not in same.stdout, same.stderr[-3000:]
    # Another config file (here one that loads the same settings) is not.
    other_file = tmp_path / "chain_copy.py"
    chain = os.path.join(REPO, "configs", "chain_tiny.py")
    other_file.write_text("from qurl_jax.config.base import load_config_file\n\n\n"
                          f"def get_config():\n    return load_config_file({chain!r})\n")
    changed = _study(f"--config={other_file}", f"--out={out}", "--quick")
    assert changed.returncode == 1
    assert "finished runs made with other settings (fp_s0, int8_acr_s0)" in changed.stderr


def test_study_rejects_an_unknown_variant(tmp_path):
    proc = _study(f"--out={tmp_path}", "--variants=fp,int4_magic")
    assert proc.returncode == 2
    assert "--variants: unknown ['int4_magic']" in proc.stderr


def test_study_rejects_a_first_seed_for_rows_run_under_the_first_seed_only(tmp_path):
    proc = _study(f"--out={tmp_path}", "--variants=int8_acr,fp_train_fp8_block_rollout",
                  "--first_seed=1")
    assert proc.returncode == 2
    unseeded = "['fp_train_fp8_block_rollout'] run under the first seed only"
    assert f"--first_seed=1: {unseeded}" in proc.stderr
    assert not list(tmp_path.iterdir())  # refused before anything is written


# ----------------------------------------------------------------------------- the papers' rows


def test_row_sets_fit_their_configs():
    from qurl_jax.config.base import load_config_file
    from qurl_jax.study import runner

    known = {v.name: v for v in runner.VARIANTS}
    for name, rows in runner.ROW_SETS.items():
        variants = [known[v] for v in rows.variants]
        assert all(v.seeded for v in variants) and rows.seeds == 2, name
        config = load_config_file(os.path.join(REPO, rows.config))
        runner.check_rows(config, variants)  # what the runner checks at import and before runs
        for v in variants:  # the compressed rows keep at most half of the longest row
            c = runner._configured(config, v.overrides, v.name)
            if runner.MB4.items() <= v.overrides.items():  # the several-minibatch rows
                assert c.rl.num_minibatches == 4 and c.rl.num_micro_batches == 2
            if c.rollout.kv_policy != "dense":
                assert 2 * c.rollout.kv_budget <= c.data.max_prompt_len + c.rollout.max_new_tokens
    long = runner.ROW_SETS["smollm2_acr_tis_long"]  # saved every 8 steps: resumable
    assert long.steps > 8 and long.steps % long.checkpoint_every == 0
    assert runner.checkpointing(long.steps, long.checkpoint_every) == {
        "train.checkpoint_every": 8, "train.keep_checkpoints": 1}
    assert runner.checkpointing(8, 0) == {"train.checkpoint_every": 8}  # the other row sets
    cap = runner.ROW_SETS["smollm2_acr_tis_cap"]  # the long pair at a smaller TIS cap, alone
    assert [known[v].overrides for v in cap.variants] == [
        {**known[v].overrides, "rl.cap": 1.5} for v in long.variants]
    base = load_config_file(os.path.join(REPO, cap.config))
    pair = [runner._configured(base, known[v].overrides, v) for v in cap.variants]
    assert [c.rl.loss_mode for c in pair] == ["tis", "acr"]
    assert all(c.rl.cap == 1.5 < base.rl.cap for c in pair)
    assert all(c.optim.warmup_steps == 16 for c in pair) and cap.steps % cap.checkpoint_every == 0
    sparse = runner.ROW_SETS["smollm2_sparse_rl"].variants
    assert {p for v in sparse for p in known[v].evals} == {"rkv", "snapkv"}
    assert known["fp_mb4"].evals == ("rkv", "snapkv")


@pytest.mark.parametrize("overrides, message", [
    ({"rl.num_minibatchez": 4}, "rl.num_minibatchez=4"),
    ({"rl.num_minibatches": "four"}, "rl.num_minibatches='four'"),
    ({"rl.num_minibatches": 3}, "rl.num_minibatches=3 does not divide the rollout batch of 64"),
    ({"rl.num_minibatches": 4, "rl.num_micro_batches": 3},
     "rl.num_micro_batches=3 does not divide the minibatch of 16"),
    ({"rollout.kv_policy": "rkv", "rollout.kv_budget": 128},
     "rollout.kv_budget=128 keeps more than half of the longest row"),
    ({"rollout.kv_policy": "rkv", "rollout.kv_budget": 64, "rollout.kv_window": 64},
     "rollout.kv_window=64 must be below"),
    ({"rollout.kv_policy": "snapkv", "rollout.kv_budget": 64, "rollout.kv_interval": 128},
     "rollout.kv_interval=128 exceeds the response of 96 tokens"),
])
def test_check_rows_names_the_variant_and_the_field(overrides, message):
    from qurl_jax.config.base import load_config_file
    from qurl_jax.study.runner import RowError, Variant, check_rows

    config = load_config_file(os.path.join(REPO, "configs/smollm2_135m_word_compare.py"))
    with pytest.raises(RowError, match="^bad_row: .*" + message.replace("(", r"\(")):
        check_rows(config, [Variant("bad_row", overrides, True, "bad")])
    evaluated = Variant("ok", {}, True, "ok", evals=("rkv",))
    check_rows(config, [evaluated])  # the evaluation's own fields are checked too
    with pytest.raises(RowError, match="^ok evaluated under rkv: .*rollout.kv_budget=200"):
        check_rows(config, [Variant("ok", {"rollout.kv_budget": 200}, True, "ok",
                                    evals=("rkv",))])


@pytest.mark.parametrize("args, message", [
    (["--rows=smollm2_nothing"], "--rows='smollm2_nothing' is not one of"),
    (["--rows=smollm2_kv8", "--variants=fp"], "sets the config and variants"),
    (["--rows=smollm2_kv8", "--lock=/tmp/x.lock", "--jobs=2"], "use --jobs=1, not 2"),
])
def test_study_rejects_bad_row_set_flags(tmp_path, args, message):
    proc = _study(f"--out={tmp_path}", *args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not list(tmp_path.iterdir())


def test_same_command_ignores_the_evaluation_before_rl_and_how_the_config_is_named():
    from qurl_jax.study.runner import same_command

    a = ["python", "--config.seed=0", "--config.eval.before=True", "--config.rl.cap=2.0"]
    assert same_command(a, ["python", "--config.seed=0", "--config.eval.before=False",
                            "--config.rl.cap=2.0"])
    assert not same_command(a, ["python", "--config.seed=1", "--config.eval.before=True",
                                "--config.rl.cap=2.0"])
    # The config named relative to the repository root or by its absolute path is one config.
    from qurl_jax.runtime import paths
    rel = ["python", "--config=configs/smollm2_135m_word_compare.py", "--config.seed=0"]
    absolute = ["python", f"--config={paths.REPO_ROOT}/configs/smollm2_135m_word_compare.py",
                "--config.seed=0"]
    assert same_command(rel, absolute)
    assert not same_command(rel, ["python", "--config=configs/smollm2_135m_word.py",
                                  "--config.seed=0"])


def test_run_all_takes_the_lock_per_job_and_follows_prerequisites(tmp_path, monkeypatch):
    import fcntl
    import threading

    from qurl_jax.study import runner
    from qurl_jax.study.runner import FileLock, Job, run_all

    monkeypatch.setattr(runner, "SPENT_EVERY_S", 0.2)  # written down while "a" runs, too

    def job(name, code, needs=None):
        return Job(name, str(tmp_path / name.split()[0]), f"{name.split()[-1]}.json",
                   [sys.executable, "-c", code], needs=needs)

    jobs = [job("a", "import time; time.sleep(1.5)"),
            job("a then", "import time; time.sleep(1)", needs="a"),
            job("c", "raise SystemExit(3)"), job("c then", "pass", needs="c")]
    os.makedirs(jobs[0].workdir)
    jobs[0].keep_spent(100.0, 5.0)  # an earlier attempt of "a", stopped: it counts
    lock_path = tmp_path / "machine.lock"
    holder = open(lock_path, "a")
    fcntl.flock(holder, fcntl.LOCK_EX)
    threading.Timer(1.0, lambda: fcntl.flock(holder, fcntl.LOCK_UN)).start()
    failed = run_all(jobs, 1, FileLock(str(lock_path)))
    holder.close()
    assert failed == ["c", "c then"]
    first, second = jobs[0].done(), jobs[1].done()
    assert first["lock_wait_s"] >= 0.5 and second["lock_wait_s"] < 0.5  # held by the test first
    assert first["peak_rss_gb"] == 5.0  # the earlier attempt's, the larger
    assert 0.001 < second["peak_rss_gb"] < 1.0  # a Python process, sampled while it slept
    assert 101.0 < first["wall_s"] < 110.0 and first["command"] == jobs[0].command
    assert 0.0 < second["wall_s"] < 10.0  # one attempt
    assert jobs[2].done() is None and jobs[3].done() is None
    assert 0.0 < jobs[2].spent()[0] < 10.0  # a failed attempt's time is kept for the next
    assert run_all(jobs[:2], 1) == []  # finished jobs are not run again


def test_summarize_run_reads_shares_cost_and_compressed_evaluations(tmp_path):
    from qurl_jax.study.runner import DONE, summarize_run

    rows = [{"step": 0, "eval/test/greedy_acc": 0.25}]
    for step, (rollout, recompute, update) in enumerate([(5.0, 1.0, 4.0), (6.0, 1.0, 3.0),
                                                          (2.0, 1.0, 1.0)], start=1):
        rows.append({"step": step, "time/step_s": rollout + recompute + update + 2.0,
                     "time/rollout_s": rollout, "time/logp_recompute_s": recompute,
                     "time/update_s": update, "rollout/reward_mean": 0.1 * step,
                     "rollout/kv_bytes_per_row": 4096.0, "acr/bound_frac": 0.5 * step})
    rows.append({"step": 3, "eval/test/greedy_acc": 0.5, "eval/test/avg@4": 0.4})
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / DONE).write_text(json.dumps({"wall_s": 90.0, "peak_rss_gb": 7.5}))
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "step_3_rkv.json").write_text(json.dumps(
        {"step": 3, "metrics": {"test/greedy_acc": 0.125, "test/num_examples": 64.0}}))
    out = summarize_run(str(tmp_path), evals=("rkv", "snapkv"))
    # Steps 2 and 3 (step 1 compiles): learner (1 + 3) / 12 and (1 + 1) / 6, ACR 1.0 and 1.5.
    assert out["learner_share"] == pytest.approx((4 / 12 + 2 / 6) / 2)
    assert out["acr/bound_frac"] == pytest.approx(1.25)
    assert out["kv_kib_per_row"] == 4.0 and out["wall_min"] == 1.5 and out["peak_rss_gb"] == 7.5
    assert out["eval/test/greedy_acc"] == 0.5 and out["eval/test/avg@4"] == 0.4
    assert out["eval/rkv_cache/test/greedy_acc"] == 0.125  # snapkv's was never written
    assert not any("snapkv" in k or "num_examples" in k for k in out)
