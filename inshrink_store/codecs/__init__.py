"""Codecs: `inshrink.nuq` (non-uniform quantization), `inshrink.vdelta` (reorder-aware delta) and
`inshrink.bytegroup` (lossless floats by byte plane).

Stateless, self-describing, deterministic; registered with numcodecs and zarr v3
through entry points under the same namespaced id. This package never imports the
storage layer.
"""
