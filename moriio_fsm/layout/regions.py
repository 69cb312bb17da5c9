"""What each layer registers with the transfer engine: one byte region per layer.

Rule: a region starts at the layer tensor's first byte and reaches past its last block,
because plan offsets are measured from that first byte; its byte view is contiguous, as
engines that register torch tensors require.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from moriio_fsm.layout.describe import describe_layer
from moriio_fsm.layout.geometry import LayerGeometry, layout_error
from moriio_fsm.layout.kv_format import LayerKVFormat


@dataclass(frozen=True)
class RegistrationRegion:
    """The bytes ``[0, size_bytes)`` after a layer tensor's first byte that transfers touch."""

    layer_name: str
    size_bytes: int
    geometry: LayerGeometry

    def byte_view(self, tensor: torch.Tensor) -> torch.Tensor:
        """A contiguous 1-D ``uint8`` tensor aliasing this region of ``tensor``'s storage.

        Writing through it writes the layer's cache. Raises ``KVLayoutError`` when
        ``tensor`` does not have the geometry this region was computed for.
        """
        geometry = self.geometry
        same_geometry = (
            tuple(tensor.shape) == geometry.shape
            and tuple(tensor.stride()) == geometry.stride
            and tensor.dtype == geometry.dtype
        )
        if not same_geometry:
            raise layout_error(
                self.layer_name,
                tuple(tensor.shape),
                f"with strides {tuple(tensor.stride())} and dtype {tensor.dtype} "
                "is not the tensor this region was made for",
                f"shape {geometry.shape}, strides {geometry.stride}, dtype {geometry.dtype}",
            )
        elements = self.size_bytes // geometry.element_size
        flat = torch.as_strided(tensor, (elements,), (1,), tensor.storage_offset())
        return flat.view(torch.uint8)


def registration_region(
    layer_name: str, tensor: torch.Tensor, kv_format: LayerKVFormat
) -> RegistrationRegion:
    """The region ``layer_name`` registers; raises ``KVLayoutError`` as ``describe_layer`` does."""
    geometry = describe_layer(layer_name, tensor, kv_format)
    return RegistrationRegion(layer_name, geometry.extent_bytes(), geometry)


def registration_regions(
    kv_caches: Mapping[str, torch.Tensor], formats: LayerKVFormat | Mapping[str, LayerKVFormat]
) -> dict[str, RegistrationRegion]:
    """Regions for every layer of ``kv_caches`` (as vLLM's ``register_kv_caches`` passes them).

    ``formats`` is one kv_format for all layers or one per layer name; a layer without a kv_format
    raises ``KeyError`` naming it.
    """
    regions = {}
    for layer_name, tensor in kv_caches.items():
        if isinstance(formats, LayerKVFormat):
            kv_format = formats
        else:
            try:
                kv_format = formats[layer_name]
            except KeyError:
                raise KeyError(
                    f"layer {layer_name!r} has a KV cache tensor but no LayerKVFormat"
                ) from None
        regions[layer_name] = registration_region(layer_name, tensor, kv_format)
    return regions
