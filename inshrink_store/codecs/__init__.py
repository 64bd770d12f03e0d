"""Codecs: `inshrink.nuq` (non-uniform quantization), `inshrink.vdelta` (reorder-aware delta) and
`inshrink.bytegroup` (lossless floats by byte plane).
Layer: codecs, storage and structure (siblings, none importing another), above the helpers.

Stateless, self-describing, deterministic; registered with numcodecs and zarr v3
through entry points under the same namespaced id. This package never imports the
storage layer.
"""
