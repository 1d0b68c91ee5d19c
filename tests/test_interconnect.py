"""plan.interconnect (and its command line, bench.interconnect): the rollout's decode step on a
whole slice, collectives included."""

import dataclasses
import json

import pytest

from qurl_jax.bench import interconnect as interconnect_cli
from qurl_jax.config.base import base_config
from qurl_jax.config.settings import RunSettings
from qurl_jax.models import ModelConfig, hf
from qurl_jax.plan import collectives, interconnect, roofline
from tests.compile_only import compiler_or_skip

# A vocabulary and MLP wider than the model, as in real LMs, so that a layout that moves logits
# or MLP partial sums every token shows it.
CFG = ModelConfig(model_type="qwen2", vocab_size=2048, hidden_size=128, intermediate_size=512,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, attention_bias=True,
                  dtype="bfloat16")


def _settings(tmp_path, fsdp: int) -> RunSettings:
    with open(tmp_path / "tiny.json", "w") as f:
        json.dump(hf.config_to_hf(CFG), f)
    c = base_config()
    c.model.path = "checkpoints/tiny"
    c.model.dtype = "bfloat16"
    c.data.prompts_per_step, c.rollout.n = 8, 4
    c.data.max_prompt_len, c.rollout.max_new_tokens = 16, 32
    c.mesh.data, c.mesh.fsdp = 4 // fsdp, fsdp
    return RunSettings.from_config(c)


def test_ring_hops_and_link_seconds() -> None:
    ar = collectives.Collective("all-reduce", "f32", (8,), 1000, group=8)
    ag = collectives.Collective("all-gather", "s8", (8,), 1000, group=8)
    cp = collectives.Collective("collective-permute", "f32", (8,), 1000)
    mine = collectives.Collective("all-reduce", "f32", (8,), 1000, group=1)
    assert [interconnect.hops(c) for c in (ar, ag, cp, mine)] == [8, 4, 1, 0]
    link = interconnect.Link(ring_bytes_per_s=1e9, all_ports_bytes_per_s=2e9, hop_s=1e-6)
    t = interconnect.link_seconds([ar, ag, cp, mine], link)
    sent = 1000 * 2 * 7 / 8 + 1000 * 7 / 8 + 1000  # ring bytes; a group of one sends nothing
    assert t["links_s"] == pytest.approx(sent / 1e9)
    assert t["links_all_ports_s"] == pytest.approx(sent / 2e9)
    assert t["latency_s"] == pytest.approx(13e-6)
    nv = interconnect.Link(ring_bytes_per_s=1e9, all_ports_bytes_per_s=1e9, collective_s=6e-6)
    assert interconnect.link_seconds([ar, ag, cp], nv)["latency_s"] == pytest.approx(18e-6)


def test_step_adds_the_links_to_the_hbm_bound() -> None:
    found = [collectives.Collective("all-reduce", "s32", (512, 8960), 512 * 8960 * 4, group=8)]
    alone = interconnect.step("v5p", "int8", 2.765e9, 1e9, [])
    assert alone["step_ms"] == pytest.approx(1.0) and alone["bound"] == "hbm"
    moved = interconnect.step("v5p", "int8", 2.765e8, 1e9, found)  # 0.1 ms of HBM
    assert moved["links_ms"] == pytest.approx(found[0].link_bytes / 200e9 * 1e3)
    assert moved["latency_ms"] == pytest.approx(8e-3)
    assert moved["links_ms"] > 0.1
    assert moved["step_ms"] == pytest.approx(0.1 + moved["links_ms"] + moved["latency_ms"])
    assert moved["bound"] == "links"
    assert set(interconnect.LINKS) <= set(roofline.CHIPS)


@pytest.mark.slow  # two refilling decode compiles by libtpu: 20-40 s on two shared cores
def test_sharded_actor_pays_collectives_a_replica_does_not(tmp_path) -> None:
    # The tiny model's decode on a 4-chip v5e slice, in the learner's fsdp layout and with the
    # actor replicated: the same rows on the slice; the sharded actor's decode all-reduces MLP
    # partial sums and logits every token, the replicas only per-slot flags.
    target = compiler_or_skip("tpu:v5e-4")
    lines = []
    sharded = interconnect.predict(_settings(tmp_path, 4), str(tmp_path), target, "learner",
                                   log=lines.append)
    replica = interconnect.predict(_settings(tmp_path, 4), str(tmp_path), target, "rollout",
                                   log=lines.append)
    assert sharded["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1}
    assert sharded["layout"] == "learner" and replica["layout"] in (
        "rollout", "replicated (stands in for the rollout layout)")
    assert replica["actor_fraction"] == 1.0 and sharded["actor_fraction"] < 0.5
    assert sharded["slice_rows"] == replica["slice_rows"] > 0
    assert sharded["collectives"]["count"] > replica["collectives"]["count"]
    # every row's vocabulary-wide logits or MLP-wide partial sums cross the links every token
    assert sharded["collectives"]["bytes"] >= sharded["slice_rows"] * CFG.intermediate_size
    assert replica["collectives"]["bytes"] < sharded["collectives"]["bytes"] / 100
    assert sharded["links_ms"] > replica["links_ms"]
    assert replica["tokens_per_s"] == pytest.approx(
        replica["slice_rows"] / replica["step_ms"] * 1e3)
    assert any("decode loop, per token per device" in line for line in lines)
    table = interconnect_cli.markdown_table([sharded, replica]).splitlines()
    assert len(table) == 4 and "| 1.00x |" in table[2]


def test_cli_rejects_a_chip_without_link_figures() -> None:
    with pytest.raises(SystemExit, match="bad flag --target=cpu"):
        interconnect_cli.main(["--config=configs/arith_tiny.py", "--target=cpu"])
    with pytest.raises(SystemExit, match=r"bad flag --set=rollout.nope=1: .*no config field"):
        interconnect_cli.main(["--config=configs/arith_tiny.py", "--target=tpu:v5p-8",
                           "--set", "rollout.nope=1", "--reshard"])
    config = base_config()
    interconnect_cli.set_field(config, "rollout.quantize_vocab=False")
    assert config.rollout.quantize_vocab is False
    with pytest.raises(TypeError):
        interconnect_cli.set_field(config, "rollout.quantize_vocab=yes please")
    with pytest.raises(SystemExit, match="bad flag --layouts=config"):
        interconnect_cli.main(["--config=configs/arith_tiny.py", "--target=tpu:v5p-8",
                           "--layouts=config"])


def test_reshard_prediction_is_the_received_bytes_over_the_ring(tmp_path) -> None:
    # The tiny model's int8 actor on a 4-chip v5e slice (fsdp 4): each one-chip replica receives
    # 3/4 of every array the learner's layout splits, over one port's ring bandwidth, plus a
    # ring latency per moved array. Only the requantize program compiles (its shardings).
    target = compiler_or_skip("tpu:v5e-4")
    settings = _settings(tmp_path, 4)
    r = interconnect.reshard(settings, str(tmp_path), target)
    assert r["rollout_mesh"] == {"data": 4, "fsdp": 1, "tensor": 1}
    kernels = 2 * 128 * (3 * 512 + 128 + 128 + 64 + 64)  # 2 layers' q, k, v, o, MLP kernels
    vocab = 2 * CFG.vocab_size * CFG.hidden_size  # the embedding and the untied LM head
    assert r["quantized_parameters"] == kernels + vocab
    # Codes and scales only (rollout.quantize_vocab, the default): 3/4 of a byte per parameter
    # plus the scales; what else moves is the norms and biases.
    assert r["codes_bytes_per_quantized_param"] == pytest.approx(0.75, abs=0.03)
    assert r["bytes_per_quantized_param"] == pytest.approx(
        r["codes_bytes_per_quantized_param"], abs=0.01)
    # Without it the bf16 vocabulary tables move too: 2 bytes each, over the kernels' codes.
    bf16 = interconnect.reshard(dataclasses.replace(settings, rollout=dataclasses.replace(
        settings.rollout, quantize_vocab=False)), str(tmp_path), target)
    assert bf16["quantized_parameters"] == kernels
    assert bf16["bytes_per_quantized_param"] == pytest.approx(
        0.75 * (kernels + 2 * vocab) / kernels, rel=0.05)
    link = interconnect.LINKS["v5e"]
    assert r["latency_ms"] == pytest.approx(r["arrays_moved"] * 2 * link.hop_s * 1e3)
    assert r["reshard_ms"] == pytest.approx(
        r["reshard_bytes_per_device"] / link.ring_bytes_per_s * 1e3 + r["latency_ms"])
    assert "reshard_ms_cross_node" not in r and "a prediction" in interconnect.describe_reshard(r)
