"""Row-invariant CPU kernels: every token of a forward computed exactly as it would be alone.

Speculative decoding is lossless only if verifying a token inside a tree gives the same numbers
as decoding it alone. Library kernels do not promise that: BLAS and oneDNN pick other blockings
(and so other summation orders) for other row counts, SDPA rounds differently with the number
of queries and masked keys. These kernels fix every output element's reduction order so that it
depends on nothing but its own inputs:

- ``ops.linear``: a small-M matrix product (M <= 64 rows is what verification needs; any M
  works) that streams each weight once for all rows, threads over output columns, reads fp32,
  bf16, int8 or 4-bit (GGUF Q4_1) weights and accumulates in fp32, lane k % 16 then a fixed
  16-lane tree (bf16 weights: in AVX-512 BF16's dot-product order, which that instruction runs
  where the CPU has it); the AVX-512 and AVX2 paths give the same bits.
- ``ops.attention``: each query row visits only the keys its mask allows, in key order, so a
  masked key (another branch of the tree, padding) changes nothing.

``modules.install_kernels`` puts them under a loaded target (``TargetSpec.kernels``, on by
default); ``selfspec.lean_body`` then routes attention through them too. ``extension`` builds
the C++ sources in ``csrc/`` once per machine; where that fails, ``ops`` falls back to pure
torch (row by row: exact, slower) with one warning. ``weights`` and ``gguf`` hold the weight
formats, including a GGUF file's own quantized blocks.
"""
