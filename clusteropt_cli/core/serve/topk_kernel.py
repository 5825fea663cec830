"""The k largest values of each row of a [rows, vocabulary] tensor, for the top-k sampling thresholds.

torch.topk of 64 values of one 128k-vocabulary row took 61 µs in a CUDA graph on an H200 and the stable sort of the
row 56 µs: one row is one slice, reduced by few blocks. Here two Triton passes: every CHUNK-wide piece of every row
gives its K largest (tl.topk: a bitonic partial sort in registers, one program per piece), then one program per row
takes the K largest of those candidates (the K largest of a row are among its pieces' K largest). K = 64: 20 µs for one
row, 31 µs for 8 rows and 127 µs for 64 in the same measurement (torch.topk: 61, 67 and 138 µs).

Off CUDA, without Triton (or its tl.topk), or for a K that is not a power of two or above MAX_K (or a vocabulary
whose candidates would not fit one program), torch.topk gives the same values.

top_entries gives the values with their token ids in a stable sort's order (value descending, ties by token id):
the same two passes over 64-bit keys, the value's bits (mapped so that integer order is float order) above the
complement of the token id. Without the kernel: torch.topk of the same keys (distinct, so exact).
"""

from __future__ import annotations

from typing import Any

CHUNK = 2048  # the piece of a row one program reduces (a power of two, at least K)
MAX_K = 128  # the final pass sorts pieces × K candidates in one program's shared memory (K = 1024 needs 256 KiB)

_kernels: Any = None
_error: str | None = None


def kernel_error() -> str | None:
    """Why the Triton path is not used on CUDA (None: it is)."""
    global _error
    if _error is None and _kernels is None:
        try:
            _build()
        except Exception as exc:  # noqa: BLE001 - torch.topk serves instead
            _error = f"{type(exc).__name__}: {exc}"
    return _error


def disable(reason: str) -> None:
    """Stop using the Triton path in this process (a launch or capture failed): torch.topk from now on."""
    global _error
    _error = reason


def _build() -> None:
    global _kernels
    import triton
    import triton.language as tl

    if not hasattr(tl, "topk"):
        raise RuntimeError(f"triton {triton.__version__} has no tl.topk")

    @triton.jit
    def pieces(x_ptr, out_ptr, vocab, stride, num_pieces, CHUNK: tl.constexpr, K: tl.constexpr):
        row = tl.program_id(0)
        piece = tl.program_id(1)
        offs = piece * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(x_ptr + row * stride + offs, mask=offs < vocab, other=float("-inf"))
        tl.store(out_ptr + (row * num_pieces + piece) * K + tl.arange(0, K), tl.topk(x, K))

    @triton.jit
    def rows(cand_ptr, out_ptr, n, P: tl.constexpr, K: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, P)
        x = tl.load(cand_ptr + row * n + offs, mask=offs < n, other=float("-inf"))
        tl.store(out_ptr + row * K + tl.arange(0, K), tl.topk(x, K))

    @triton.jit
    def entry_pieces(x_ptr, scale_ptr, out_ptr, vocab, stride, num_pieces, CHUNK: tl.constexpr, K: tl.constexpr):
        row = tl.program_id(0)
        piece = tl.program_id(1)
        offs = piece * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(x_ptr + row * stride + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        x = x * tl.load(scale_ptr + row)  # the row's 1 / temperature (the product process_logits would form)
        x = tl.where(x == 0.0, 0.0, x)  # -0.0 ties with 0.0, as in a sort
        bits = x.to(tl.int32, bitcast=True)
        ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # integer order = float order
        keys = (ordered.to(tl.int64) << 32) | (0xFFFFFFFF - offs.to(tl.int64))  # ties: the smaller id first
        tl.store(out_ptr + (row * num_pieces + piece) * K + tl.arange(0, K), tl.topk(keys, K))

    @triton.jit
    def entry_rows(cand_ptr, val_ptr, idx_ptr, n, P: tl.constexpr, K: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, P)
        keys = tl.load(cand_ptr + row * n + offs, mask=offs < n, other=0)
        keys = tl.where(offs < n, keys, -9223372036854775807)
        top = tl.topk(keys, K)
        ordered = (top >> 32).to(tl.int32)
        bits = tl.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF)
        out = row * K + tl.arange(0, K)
        tl.store(val_ptr + out, bits.to(tl.float32, bitcast=True))
        tl.store(idx_ptr + out, 0xFFFFFFFF - (top & 0xFFFFFFFF))

    _kernels = {"values": (pieces, rows), "entries": (entry_pieces, entry_rows)}


def top_values(x: Any, k: int) -> Any:
    """[rows, V] → [rows, k]: each row's k largest values, largest first (torch.topk(x, k).values)."""
    if not _usable(x, k):
        return x.topk(k, dim=-1, sorted=True).values
    return _triton_top_values(x, k)


def _usable(x: Any, k: int) -> bool:
    """Whether the Triton passes serve this tensor and k (see the module's docstring)."""
    vocab = x.shape[-1]
    return (x.is_cuda and x.dtype.is_floating_point and k <= MAX_K and k & (k - 1) == 0 and vocab > CHUNK
            and vocab * k <= 64 * CHUNK * MAX_K and x.stride(-1) == 1 and kernel_error() is None)


def top_entries(x: Any, k: int, scale: Any = None) -> tuple[Any, Any]:
    """[rows, V] → ([rows, k] float32 values, [rows, k] int64 token ids): each row's first k entries in a stable
    descending sort's order (value descending, equal values by token id; -0.0 counts as 0.0). `scale` [rows]
    float32: each row multiplied by its factor first (the sampler's 1 / temperature), inside the first pass."""
    if _usable(x, k):
        return _triton_top_entries(x, k, scale)
    return _torch_top_entries(x, k, scale)


def _torch_top_entries(x: Any, k: int, scale: Any = None) -> tuple[Any, Any]:
    """top_entries with torch ops: the same 64-bit keys, all distinct, so torch.topk's order is the stable sort's."""
    import torch

    vocab = x.shape[-1]
    xf = x.float() if scale is None else x.float() * scale[:, None]
    xf = torch.where(xf == 0, torch.zeros_like(xf), xf)
    bits = xf.view(torch.int32)
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(torch.int64)
    ids = torch.arange(vocab, device=x.device, dtype=torch.int64)
    keys = (ordered << 32) | (0xFFFFFFFF - ids)
    top = keys.topk(min(k, vocab), dim=-1, sorted=True).values
    hi = (top >> 32).to(torch.int32)
    values = torch.where(hi >= 0, hi, hi ^ 0x7FFFFFFF).view(torch.float32)
    return values, 0xFFFFFFFF - (top & 0xFFFFFFFF)


def _two_passes(x: Any, k: int, kind: str, candidate_dtype: Any, *outputs: Any, scale: Any = None) -> None:
    """Launch one kernel pair (kind "values" or "entries"): every CHUNK-wide piece's k largest into a candidate
    buffer, then each row's k largest of those into `outputs`. `scale`: the entries pass's per-row factors."""
    import torch
    import triton

    if _kernels is None:
        _build()
    pieces, final = _kernels[kind]
    rows, vocab = x.shape
    num_pieces = triton.cdiv(vocab, CHUNK)
    candidates = torch.empty(rows, num_pieces * k, device=x.device, dtype=candidate_dtype)
    inputs = (x,) if kind == "values" else (x, scale)
    pieces[(rows, num_pieces)](*inputs, candidates, vocab, x.stride(0), num_pieces, CHUNK=CHUNK, K=k, num_warps=4)
    final[(rows,)](candidates, *outputs, num_pieces * k, P=triton.next_power_of_2(num_pieces * k), K=k,
                   num_warps=8)


def _triton_top_entries(x: Any, k: int, scale: Any = None) -> tuple[Any, Any]:
    """The two Triton passes over 64-bit keys (also run on CPU tensors under TRITON_INTERPRET=1 by the tests)."""
    import torch

    values = torch.empty(x.shape[0], k, device=x.device, dtype=torch.float32)
    ids = torch.empty(x.shape[0], k, device=x.device, dtype=torch.int64)
    if scale is None:
        scale = torch.ones(x.shape[0], device=x.device, dtype=torch.float32)
    _two_passes(x, k, "entries", torch.int64, values, ids, scale=scale.float().contiguous())
    return values, ids


def _triton_top_values(x: Any, k: int) -> Any:
    """The two Triton passes (also run on CPU tensors under TRITON_INTERPRET=1 by the tests)."""
    import torch

    out = torch.empty(x.shape[0], k, device=x.device, dtype=x.dtype)
    _two_passes(x, k, "values", x.dtype, out)
    return out
