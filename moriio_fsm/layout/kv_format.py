"""What the layout code needs to know about one layer's KV cache, independent of vLLM.

``LayerKVFormat`` is plain, frozen and hashable so it can be part of a plan cache key.
vLLM is optional: ``LayerKVFormat.from_vllm`` imports it only when called.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CPU_ATTN = "CPU_ATTN"
"""vLLM's CPU attention backend (``CPUAttentionBackend.get_name()``), the one backend whose cache layout
cannot be told from the tensor alone (see ``LayerKVFormat.attention_backend``)."""


@dataclass(frozen=True)
class LayerKVFormat:
    """The scheduler-level description of one layer's KV cache.

    ``block_size`` is the scheduler's block size in tokens; the attention kernel may
    store a block as several smaller physical blocks, which the geometry detects.
    ``num_kv_heads`` and ``head_size`` are optional, but without ``num_kv_heads`` a
    kernel-block layout whose two middle axes both divide ``block_size`` cannot be
    read and is rejected. ``use_mla`` marks a single-region (latent or index-only)
    cache of shape ``[N, B, L]``. ``kv_axis`` (0 or 1) says which axis of a 5-D
    cache splits K from V; it is only needed when both leading axes have size 2.

    ``attention_backend`` is vLLM's backend name, when known. Only ``CPU_ATTN`` changes
    how the tensor is read: the CPU backend's per-layer cache ``[N, H, B, 2*D]`` packs
    each (block, head) tile's K and V in a kernel-specific order, so it can only be
    moved in whole blocks. It is named rather than detected because a 4-D shape does
    not say which backend wrote it: other backends have 4-D per-layer views too (vLLM's
    ``[blocks, heads, tokens, content]`` family) whose tiles mean something else, and
    with ``H == B`` even the axis order is unreadable. Any other name, or None, means one
    of the GPU layouts, which the shape and strides tell apart.

    Raises ``ValueError`` on construction when a field is out of range.
    """

    block_size: int
    num_kv_heads: int | None = None
    head_size: int | None = None
    use_mla: bool = False
    kv_axis: int | None = None
    attention_backend: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(
                f"LayerKVFormat.block_size must be a positive int, got {self.block_size!r}"
            )
        for name in ("num_kv_heads", "head_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(
                    f"LayerKVFormat.{name} must be a positive int or None, got {value!r}"
                )
        if self.kv_axis not in (None, 0, 1):
            raise ValueError(f"LayerKVFormat.kv_axis must be 0, 1 or None, got {self.kv_axis!r}")
        backend = self.attention_backend
        if backend is not None and (not isinstance(backend, str) or not backend):
            raise ValueError(
                f"LayerKVFormat.attention_backend must be a backend name or None, got {backend!r}"
            )
        if backend == CPU_ATTN and (self.use_mla or self.kv_axis is not None):
            raise ValueError(
                f"LayerKVFormat for {CPU_ATTN} cannot set use_mla or kv_axis: its cache is "
                "[num_blocks, num_kv_heads, block_size, 2*head_size], K and V packed in each block"
            )

    @property
    def cpu_attention(self) -> bool:
        """True for the CPU attention backend's whole-block cache layout."""
        return self.attention_backend == CPU_ATTN

    @classmethod
    def from_vllm(
        cls, vllm_spec: Any, *, kv_axis: int | None = None, attention_backend: str | None = None
    ) -> LayerKVFormat:
        """Build the format from a vLLM ``AttentionSpec`` (``FullAttentionSpec``, ``MLAAttentionSpec``...).

        MLA is recognised by the ``MLAAttentionSpec`` class, or by the ``use_mla`` flag
        that older vLLM releases carried on every attention spec. The spec does not say
        which backend allocated the cache: pass ``attention_backend`` (the backend's
        ``get_name()``, ``"CPU_ATTN"`` on the CPU) when it is known.

        Raises ``ImportError`` when vLLM is not installed and ``TypeError`` when the
        object is not an attention spec (Mamba and other state specs have no KV blocks).
        """
        try:
            import vllm.v1.kv_cache_interface as kv_cache_interface
        except ImportError as exc:
            raise ImportError(
                "LayerKVFormat.from_vllm needs the vllm package (pip install 'moriio-fsm[vllm]')"
            ) from exc
        if not isinstance(vllm_spec, kv_cache_interface.AttentionSpec):
            raise TypeError(
                f"LayerKVFormat.from_vllm expected a vLLM AttentionSpec, got {type(vllm_spec).__name__}"
            )
        # Older releases flag MLA with ``use_mla`` on every spec instead of a subclass.
        mla_class = getattr(kv_cache_interface, "MLAAttentionSpec", None)
        use_mla = (mla_class is not None and isinstance(vllm_spec, mla_class)) or bool(
            getattr(vllm_spec, "use_mla", False)
        )
        return cls(
            block_size=int(vllm_spec.block_size),
            num_kv_heads=int(vllm_spec.num_kv_heads),
            head_size=int(vllm_spec.head_size),
            use_mla=use_mla,
            kv_axis=kv_axis,
            attention_backend=attention_backend,
        )
