"""One learner update of a real-shaped model against torch doing the same work (`bench.learner
--vs_torch`).

`python -m qurl_jax.bench.learner --vs_torch [--rows=32 --max_prompt_len=40 --max_new_tokens=64]`

The model has SmolLM2-135M's shapes (hidden 576, intermediate 1536, 30 layers, 9 heads, 3 KV
heads, head_dim 64, a tied 49,152-token vocabulary) and random float32 weights; both sides get the
same weights (`models.hf.to_transformers`) and the same padded batch: `rows` sequences of a
left-padded prompt of 20..max_prompt_len tokens and a response of 16..max_new_tokens tokens.

- ours: `Learner.update` as the trainer runs it by default (packed rows, one micro-batch, the
  ACR objective, pi_prox from the update's own forward: `learner.prox`), i.e. forward, backward,
  global-norm clipping and AdamW. Beside it, `Learner.logprobs` alone: the separate pi_prox
  pass the trainer runs when it cannot take pi_prox from the update.
- torch: a `transformers` LlamaForCausalLM (sdpa attention) doing what a torch GRPO trainer's
  training part does per optimizer step: the forward with logits for the response positions only
  (`logits_to_keep`), log-softmax and gather, a policy-gradient loss, backward, global-norm
  clipping and `torch.optim.AdamW`.

Each side lives in its own worker process (so each has its own peak resident memory); after one
warm-up round each (which compiles), rounds alternate between them so that load from other
processes hits both alike. Reported: the median wall seconds of each and their ratio
(ours / torch), the same for the CPU seconds each process used in a round (user + system of all
its threads: on a CPU shared with other work, the figure the others' load moves least), and
each process's peak RSS over the timed rounds (VmHWM after a reset, Linux). Then one more update
of ours runs under `jax.profiler` and the time its XLA:CPU operations are in flight is split into
matrix products, transposes (layout copies) and the rest (`op_time_split`, which follows
asynchronous operations such as Eigen's products to their end): where our time goes, beside the
profiled update's own wall time.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
from typing import Any

import numpy as np

SMOLLM2_135M = dict(model_type="llama", vocab_size=49152, hidden_size=576,
                    intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
                    head_dim=64, tie_word_embeddings=True, rope_theta=100000.0,
                    rms_norm_eps=1e-5)


def smollm2_shapes(layers: int = 30):
    from qurl_jax.models import ModelConfig

    return ModelConfig(**{**SMOLLM2_135M, "num_layers": layers})


def batch(rows: int, max_prompt_len: int, max_new_tokens: int, vocab: int,
          seed: int = 0) -> dict[str, np.ndarray]:
    """A padded learner batch (numpy): prompts of 20..max_prompt_len, responses of
    16..max_new_tokens tokens (uniform)."""
    from qurl_jax.bench.learner_flops import padded_batch

    rng = np.random.default_rng(seed)
    p, g = max_prompt_len, max_new_tokens
    prompt = rng.integers(min(20, p), p + 1, rows)
    resp = rng.integers(min(16, g), g + 1, rows)
    return padded_batch(rng, prompt, resp, p, g, vocab)


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_gb() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1e6
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


class _Ours:
    def __init__(self, host: dict[str, np.ndarray], layers: int, seed: int,
                 learner_kw: dict[str, Any] | None = None) -> None:
        import jax
        import jax.numpy as jnp

        from qurl_jax.learner.learner import Learner, OptimConfig
        from qurl_jax.models import init_params
        from qurl_jax.parallel import sharding as shd
        from qurl_jax.rl.objectives import ObjectiveConfig

        self.jax = jax
        cfg = smollm2_shapes(layers)
        self.learner = Learner(cfg, ObjectiveConfig(), OptimConfig(learning_rate=1e-6),
                               shd.make_mesh(), packing=True,
                               logprob_batch_size=host["tokens"].shape[0], **(learner_kw or {}))
        self.params = self.learner.shard_params(init_params(cfg, jax.random.key(seed)))
        self.opt = self.learner.init_opt_state(self.params)
        self.host = {k: jnp.asarray(v) for k, v in host.items()}

    def round(self, what: str) -> float:
        jax = self.jax
        batch = self.learner.shard_batch(self.host)  # a new batch object: packing redone, timed
        jax.block_until_ready(batch)
        start, cpu = time.perf_counter(), time.process_time()
        if what == "logprobs":
            jax.block_until_ready(self.learner.logprobs(self.params, batch))
        else:
            self.params, self.opt, m = self.learner.update(self.params, self.opt, batch)
            jax.block_until_ready((self.params, m))
        return time.perf_counter() - start, time.process_time() - cpu


class _Torch:
    def __init__(self, host: dict[str, np.ndarray], layers: int, seed: int) -> None:
        import jax
        import torch

        from qurl_jax.models import init_params
        from qurl_jax.models.hf import to_transformers

        cfg = smollm2_shapes(layers)
        params = jax.device_get(init_params(cfg, jax.random.key(seed)))
        self.model = to_transformers(cfg, params, attn_implementation="sdpa").train()
        del params
        self.torch = torch
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-6, weight_decay=0.01)
        g = host["resp_mask"].shape[1]
        self.g = g
        self.tokens = torch.from_numpy(host["tokens"].astype(np.int64))
        self.mask = torch.from_numpy(host["attn_mask"].astype(np.int64))
        self.positions = torch.from_numpy(host["positions"].astype(np.int64))
        self.resp_mask = torch.from_numpy(host["resp_mask"])
        self.adv = torch.from_numpy(host["advantages"])

    def round(self, what: str) -> float:
        torch = self.torch
        start, cpu = time.perf_counter(), time.process_time()
        # Logits of the positions that predict the response tokens only, as TRL's GRPO trainer.
        logits = self.model(input_ids=self.tokens, attention_mask=self.mask,
                            position_ids=self.positions, logits_to_keep=self.g + 1).logits
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(
            -1, self.tokens[:, -self.g:, None])[..., 0]
        ratio = torch.exp(logp - logp.detach())
        loss = -(ratio * self.adv[:, None] * self.resp_mask).sum() / self.resp_mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return time.perf_counter() - start, time.process_time() - cpu


def op_time_split(trace_dir: str) -> dict[str, float]:
    """Seconds per kind of XLA:CPU operation in the perfetto trace `jax.profiler` wrote under
    `trace_dir`: `matmul` (dot and YNNPACK / XNNPACK / oneDNN fusions, which hold the dots),
    `transpose` (copy fusions: layout changes, mostly the transposed operands of the weight
    gradients' products), `other` (elementwise and reduction fusions, gathers, scatters).

    An operation runs from its event's start to its "end: <name>" marker where the thunk executor
    wrote one: operations it runs asynchronously (Eigen's products, kernels split over the
    intra-op threads) return from their own event at launch (on a 2-core AMD EPYC those events
    covered a third of an update under `cpu_dots='learner'`). Operations run side by side: time
    with a product in flight counts as `matmul`, time with a copy but no product as `transpose`,
    the rest as `other`, so the kinds add up to the time some operation ran."""
    import glob
    import gzip
    import json
    import re

    files = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"),
                             recursive=True))
    if not files:
        return {}
    with gzip.open(files[-1]) as f:
        events = json.load(f)["traceEvents"]
    ends: dict[str, list[float]] = {}
    for e in events:
        name = e.get("name", "")
        if e.get("ph") == "X" and name.startswith("end: "):
            ends.setdefault(name[5:], []).append(float(e.get("ts", 0)))
    for stamps in ends.values():
        stamps.sort()
    spans: list[tuple[float, float, str]] = []  # (start, end, kind), microseconds
    for e in sorted(events, key=lambda e: float(e.get("ts", 0))):
        name = e.get("name", "")
        # An XLA operation's event names its HLO instruction (host-side events name none).
        if e.get("ph") != "X" or "hlo_op" not in e.get("args", {}):
            continue
        start = float(e.get("ts", 0))
        end = start + float(e.get("dur", 0))
        stamps = ends.get(name, [])
        while stamps and stamps[0] < start:  # an end before this start belongs to no later one
            stamps.pop(0)
        if stamps:
            end = max(end, stamps.pop(0))
        kind = re.sub(r"\.\d+$", "", name)
        kind = ("matmul" if kind.startswith(("ynn_", "xnn_", "onednn", "dot")) else
                "transpose" if kind.startswith(("copy", "transpose")) else "other")
        spans.append((start, end, kind))
    split = {"matmul": 0.0, "transpose": 0.0, "other": 0.0}
    rank = {kind: i for i, kind in enumerate(split)}  # a product in flight claims the time first
    bounds = sorted({t for a, b, _ in spans for t in (a, b)})
    active: list[tuple[float, float, str]] = []
    i = 0
    for lo, hi in zip(bounds, bounds[1:]):
        while i < len(spans) and spans[i][0] <= lo:  # spans are in order of their starts
            active.append(spans[i])
            i += 1
        active = [s for s in active if s[1] > lo]
        if active:
            split[min((s[2] for s in active), key=rank.__getitem__)] += (hi - lo) / 1e6
    return split


def _worker(side: str, host: dict[str, np.ndarray], layers: int, seed: int, conn: Any,
            learner_kw: dict[str, Any] | None = None) -> None:
    runner = (_Ours(host, layers, seed, learner_kw) if side == "ours"
              else _Torch(host, layers, seed))
    while True:
        msg = conn.recv()
        if msg == "stop":
            conn.send(None)
            return
        if msg == "reset_rss":
            conn.send(_reset_peak_rss())
        elif msg == "rss":
            conn.send(_peak_rss_gb())
        elif msg == "profile":  # one traced update: seconds per kind of operation
            import tempfile

            import jax

            with tempfile.TemporaryDirectory() as trace_dir:
                jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
                wall, _ = runner.round("update")
                jax.profiler.stop_trace()
                conn.send({"split": op_time_split(trace_dir), "wall": wall})
        else:
            conn.send(runner.round(msg))


def run(rows: int = 32, max_prompt_len: int = 40, max_new_tokens: int = 64, rounds: int = 3,
        layers: int = 30, seed: int = 0, profile: bool = True,
        log: Any = print, learner_kw: dict[str, Any] | None = None, cpu_dots: str = "auto",
        apart: bool = False) -> dict[str, float]:
    """The comparison (module doc); JSON-able figures. `learner_kw`: our `Learner`'s memory
    settings (remat, scan_layers, logprob_chunk); `cpu_dots`: our learner's XLA:CPU float
    products (`train.cpu_dots`, `qurl_jax.runtime.xla_cpu`; 'eigen' for the whole process).
    `apart`: never both processes at once, visits in the order ours, torch, torch, ours, each a
    fresh process with its own warm-up and `rounds` timed rounds (peak RSS: the larger of a
    side's two visits), for machines where the two processes' memory together presses on the
    RAM."""
    from qurl_jax.runtime import xla_cpu

    host = batch(rows, max_prompt_len, max_new_tokens, SMOLLM2_135M["vocab_size"], seed)
    learner_kw = {**(learner_kw or {}), "cpu_dots": cpu_dots}
    ctx = mp.get_context("spawn")
    workers: dict[str, tuple[Any, Any]] = {}

    def start(side: str) -> None:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(side, host, layers, seed, child, learner_kw),
                           daemon=True)
        saved = os.environ.get("XLA_FLAGS")
        if side == "ours":  # the environment the worker starts with
            os.environ["XLA_FLAGS"] = xla_cpu.xla_flags(cpu_dots, saved or "")
        proc.start()
        if saved is None:
            os.environ.pop("XLA_FLAGS", None)
        else:
            os.environ["XLA_FLAGS"] = saved
        workers[side] = (proc, parent)

    def stop(side: str) -> None:
        proc, conn = workers.pop(side)
        try:
            conn.send("stop")
            conn.recv()
        except (OSError, EOFError):
            pass
        proc.join(timeout=30)

    def ask(side: str, msg: str) -> Any:
        conn = workers[side][1]
        conn.send(msg)
        return conn.recv()

    times: dict[str, list[float]] = {"ours": [], "ours_logprobs": [], "torch": []}
    cpu: dict[str, list[float]] = {k: [] for k in times}
    rss: dict[str, float] = {}
    profiled: dict[str, Any] = {"split": {}, "wall": 0.0}
    resets: list[bool] = []

    def timed(key: str, side: str, what: str) -> None:
        wall, used = ask(side, what)
        times[key].append(wall)
        cpu[key].append(used)

    def one_round(side: str) -> None:
        if side == "torch":
            timed("torch", "torch", "update")
        else:
            timed("ours", "ours", "update")
            timed("ours_logprobs", "ours", "logprobs")

    def warm_up(side: str) -> None:
        for what in (("update", "logprobs") if side == "ours" else ("update",)):
            log(f"warm-up {side} {what}: {ask(side, what)[0]:.1f} s")
        resets.append(ask(side, "reset_rss"))

    try:
        if apart:
            for visit, side in enumerate(("ours", "torch", "torch", "ours")):
                start(side)
                warm_up(side)
                for _ in range(rounds):
                    one_round(side)
                log(f"visit {visit} ({side}): " + ", ".join(
                    f"{t:.2f} s" for t in times[side][-rounds:]))
                rss[side] = max(rss.get(side, 0.0), ask(side, "rss"))
                if profile and visit == 3:
                    profiled = ask("ours", "profile")
                stop(side)
        else:
            # Warm-up (compiles), then the peak-RSS reset, then the interleaved rounds.
            start("ours")
            start("torch")
            warm_up("ours")
            warm_up("torch")
            for i in range(rounds):
                one_round("torch")
                one_round("ours")
                log(f"round {i}: ours {times['ours'][-1]:.2f} s (logprobs "
                    f"{times['ours_logprobs'][-1]:.2f} s), torch {times['torch'][-1]:.2f} s; "
                    f"CPU seconds {cpu['ours'][-1]:.2f} ({cpu['ours_logprobs'][-1]:.2f}), "
                    f"{cpu['torch'][-1]:.2f}")
            rss = {side: ask(side, "rss") for side in workers}
            profiled = ask("ours", "profile") if profile else profiled
    finally:
        for side in list(workers):
            stop(side)
    reset = all(resets)
    out = {f"{k}/seconds": statistics.median(v) for k, v in times.items()}
    out.update({f"{k}/cpu_seconds": statistics.median(v) for k, v in cpu.items()})
    out["ratio_update_cpu_ours_over_torch"] = out["ours/cpu_seconds"] / out["torch/cpu_seconds"]
    out.update({f"{k}/peak_rss_gb": v for k, v in rss.items()})
    out["ratio_update_ours_over_torch"] = out["ours/seconds"] / out["torch/seconds"]
    split = profiled["split"]
    total = sum(split.values())
    out.update({f"ours/op_share_{k}": v / total for k, v in split.items() if total})
    if total:  # how much of the profiled update the traced operations cover
        out["ours/op_traced_seconds"] = total
        out["ours/profiled_update_seconds"] = profiled["wall"]
    out["real_tokens"] = float(host["attn_mask"].sum())
    out["rss_reset_before_rounds"] = float(reset)
    out["cpus"] = float(os.cpu_count() or 0)
    return out
