"""Compute dtype and tolerances of the tests that run in the accelerator's dtype, in one place.

A test that takes the `precision` fixture (tests/conftest.py) builds its model or inputs in
`precision.dtype` and compares with `precision.tol(NAME)`. The default suite runs float32; the
accelerator runner (`python -m tests.accelerator`) runs bfloat16 unless `--dtype float32`.

Every entry gives the float32 tolerance (the one the test always had: exact where the computation
is exact, a few float32 ulps where two programs sum in different orders) and the bfloat16 one with
its reason. A bfloat16 tolerance is a bound derived from bf16's 8 significant bits (relative
rounding 2**-9 ~ 0.2%, one ulp = 2**-7 relative) and the size of the compared values, checked
against the difference measured on XLA:CPU; it is never widened to make a failure pass without a
new reason here.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np


@dataclass(frozen=True)
class Tolerance:
    """`|actual - desired| <= atol + rtol * |desired|`, elementwise (numpy's assert_allclose)."""

    atol: float
    rtol: float = 0.0
    reason: str = ""


# name -> {dtype: Tolerance}. Names are "<test file stem>.<comparison>".
TABLE: dict[str, dict[str, Tolerance]] = {
    "model_parity.logits_vs_transformers": {
        "float32": Tolerance(1e-4, reason="same float32 math as torch; summation order only"),
        "bfloat16": Tolerance(6e-2, reason=(
            "ours in bf16 against torch in float32: weights, activations after every projection "
            "of 2 layers and the logits themselves are rounded to bf16; |logit| <= 2.4 here, "
            "whose bf16 ulp is 2**-6 = 0.016; measured max 0.028 (XLA:CPU); bound ~4 ulps")),
    },
    "model_parity.padding_invariance": {
        "float32": Tolerance(1e-5, reason="same row, different batch shape: summation order"),
        "bfloat16": Tolerance(3.2e-2, reason=(
            "both sides bf16; another batch shape runs products of other shapes (accumulation "
            "order, tiling), so a hidden state may round one bf16 ulp apart and move the logits "
            "(<= 2.4, ulp 0.016) by a few ulps of theirs; measured max 0.018 (XLA:CPU)")),
    },
    "model_parity.cache_decode_vs_full_forward": {
        "float32": Tolerance(1e-5, reason="same math; a [1, S] decode product vs a [T, S] one"),
        "bfloat16": Tolerance(3.2e-2, reason=(
            "both sides bf16 with a bf16 KV cache; decode and full forward run products of "
            "different shapes (accumulation order, tiling), so hidden states may round one bf16 "
            "ulp apart, as in padding_invariance; measured 0 (XLA:CPU), logits <= 2.4")),
    },
    "learner.scan_vs_unrolled_logits": {
        "float32": Tolerance(1e-5, reason="scanned and unrolled layers: summation order only"),
        "bfloat16": Tolerance(1.6e-2, reason=(
            "both in bf16: the scan's stacked weights give the same products, but XLA may fuse "
            "and round the two programs differently; logits <= 0.5 here: bound ~2 ulps of 1; "
            "measured max 0.002 (XLA:CPU)")),
    },
    "learner.scan_vs_unrolled_grads": {
        "float32": Tolerance(1e-5, 1e-6, reason=(
            "gradients reach ~90, float32's ulp there is 7.6e-6, the two programs sum in "
            "different orders: a few ulps apart is agreement (a CI run saw 2.3e-5 at 86.5)")),
        "bfloat16": Tolerance(1.0, 1.6e-2, reason=(
            "both in bf16 with float32 parameters: each gradient entry sums bf16-rounded "
            "products over every position; entries reach ~155 (bf16 ulp 1.0 at 128-256), and "
            "where such terms cancel into a small sum their rounding stays in it: 2 ulps "
            "relative (2**-6) plus 1.0; measured max 0.63, at most 0.3 beyond the relative "
            "part (XLA:CPU); a wrong layer order moves gradients by their own size")),
    },
    "attention.blockwise_vs_dense": {
        "float32": Tolerance(1e-5, reason="online softmax vs one softmax: summation order"),
        "bfloat16": Tolerance(2e-2, 1.6e-2, reason=(
            "q, k, v in bf16, outputs and gradients rounded to bf16: outputs O(1), gradients up "
            "to ~14; the online softmax rescales partial sums, the dense one does not: 2 bf16 "
            "ulps relative (2**-6) plus 2e-2 where sums cancel; measured max 0.008 on outputs "
            "and 0.016 on gradients of 13.7 (XLA:CPU)")),
    },
    "attention.model_switch": {
        "float32": Tolerance(1e-5, reason="the model's two attention paths; summation order"),
        "bfloat16": Tolerance(1.6e-2, reason=(
            "the model in bf16 through two attention implementations: attention outputs one "
            "bf16 ulp apart pass through o_proj, the MLP and the head; logits <= 0.4 here; "
            "measured max 0.002 (XLA:CPU)")),
    },
    "attention.cudnn_vs_dense": {
        "bfloat16": Tolerance(1e-1, 1.6e-2, reason=(
            "cuDNN's flash attention (bf16 only) vs dense on the same bf16 inputs: as "
            "blockwise_vs_dense, another accumulation order before the bf16 rounding of O(1) "
            "outputs and of gradients up to ~10 (a bf16 step there is 0.06), and cuDNN's "
            "backward multiplies bf16-rounded probabilities (2**-9 each) into dV and dK sums; "
            "measured on an H100 (2026-11-27): max 0.0212 away, 1 of 8192 d/dk entries past "
            "0.02; on an H200 (2026-11-28): 1 of 8192 d/dv entries 0.078 away (-2.406 vs "
            "-2.328, 5 bf16 ulps), the rest within 0.04")),
    },
}


@dataclass(frozen=True)
class Precision:
    """The compute dtype of a test run ('float32' or 'bfloat16') and its tolerances."""

    dtype: str

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"QURL_TEST_COMPUTE_DTYPE={self.dtype!r}: 'float32' or 'bfloat16'")

    @property
    def is_float32(self) -> bool:
        return self.dtype == "float32"

    def tol(self, name: str) -> Tolerance:
        """The tolerance of comparison `name` in this dtype (KeyError names what is missing)."""
        try:
            return TABLE[name][self.dtype]
        except KeyError:
            raise KeyError(f"tests/tolerances.py TABLE has no {self.dtype} entry "
                           f"{name!r}") from None

    def assert_close(self, actual, desired, name: str, err_msg: str = "") -> None:
        """assert_allclose in float32 with the tolerance of `name`; the message names the entry."""
        t = self.tol(name)
        np.testing.assert_allclose(
            np.asarray(actual, np.float32), np.asarray(desired, np.float32), rtol=t.rtol,
            atol=t.atol, err_msg=f"{err_msg} [{name}, {self.dtype}: {t.reason}]".strip())


def fp8_accumulation_rtol() -> float:
    """Error an FP8 x FP8 -> f32 product may add, relative to the sum of its |terms|, on the
    backend running the tests (see `test_quant.py::test_rollout_dot_general_matches_numpy`).

    0 where FP8 is emulated with float32 products and sums (CPU; TPUs without an FP8 MXU widen the
    codes to f32). On a GPU, XLA runs FP8 GEMMs in the tensor cores' fast-accumulation mode: an
    H100 keeps about 14 bits of the running sum inside an FP8 MMA (DeepSeek-V3 technical report,
    section 3.3.2), and XLA asks for no promotion to float32 (Triton GEMMs always; cuBLASLt at the
    DEFAULT precision). A model of such an accumulator (terms aligned to the largest exponent and
    truncated to 13 fraction bits, per 32-deep MMA step) errs by at most 1.7e-4 of the |terms| on
    test_quant.py's products; 2^-9 leaves ten times that. Measured on an H200 (2026-11-28, JAX
    0.11.2): test_fp8_train.py's exact operands through `fp8_block_linear` erred by 2^-13.5 to
    2^-11.9 of the |terms| at the five entries reported, at most 0.0091 where the sums of |terms|
    are <= 13.05 (>= 2^-10.5 of it: the bound's margin there is 2.8x or more)."""
    return 2.0**-9 if jax.default_backend() == "gpu" else 0.0


def assert_product_close(got: np.ndarray, want: np.ndarray, fp8_terms: np.ndarray | None = None,
                         rtol: float = 2e-5) -> None:
    """|got - want| <= rtol (|want| + max |want|), plus `fp8_accumulation_rtol()` x the sum of
    |terms| for an FP8 x FP8 product (fp8_terms: the product of the |operands|' codes, e.g.
    `test_quant.np_w8a8(..., abs_terms=True)`; E4M3 rounding is symmetric, so the emulation run
    on |operands| gives them). With rtol 0 on the CPU (float32 sums) that is exact equality."""
    tol = rtol * (np.abs(want) + np.abs(want).max())
    if fp8_terms is not None:
        tol = tol + fp8_accumulation_rtol() * fp8_terms
    err = np.abs(got - want)
    over = (err - tol).max()
    assert over <= 0, (f"max error {err.max():.3g}, over its bound by {over:.3g} at "
                       f"{np.unravel_index(np.argmax(err - tol), err.shape)}")
