"""GEMMs in a program's text: the element types of every `dot_general` in StableHLO, and the
cuBLASLt fp8 GEMMs of compiled GPU HLO. Used to check what XLA is handed and what it made of it
(the fp8 path, the precision policy, the attention and loss dtypes)."""

from __future__ import annotations

import collections
import re

_DOT_SIGNATURE = re.compile(
    r"dot_general.*:\s*\(tensor<([^>]*)>,\s*tensor<([^>]*)>\)\s*->\s*tensor<([^>]*)>")


def _element_type(tensor_type: str) -> str:
    return tensor_type.split(",")[0].split("x")[-1]


def dot_general_dtypes(stablehlo: str) -> list[tuple[str, str, str]]:
    """(lhs, rhs, result) element types of every dot_general in StableHLO text, e.g. from
    `jax.jit(f).lower(...).as_text()`: [("f8E4M3FN", "f8E4M3FN", "f32"), ...]."""
    found = []
    for line in stablehlo.splitlines():
        m = _DOT_SIGNATURE.search(line)
        if m:
            found.append(tuple(_element_type(t) for t in m.groups()))
    return found


def fp8_gemm_calls(compiled_hlo: str) -> int:
    """How many cuBLASLt fp8 GEMMs a compiled GPU program calls (`compiled.as_text()`); 0 on CPU."""
    return compiled_hlo.count("__cublas$lt$matmul$f8")


_CUBLAS_FP8 = re.compile(r"= \((\w+\[[\d,]*\])[^=]*custom-call\("
                         r".*custom_call_target=\"__cublas\$lt\$matmul\$f8\"")


def cublas_fp8_output_shapes(compiled_hlo: str) -> dict[str, int]:
    """{"bf16[8192,4096]": count} of the outputs of every cuBLASLt fp8 GEMM in optimised HLO."""
    return dict(collections.Counter(m[1] for m in _CUBLAS_FP8.finditer(compiled_hlo)))
