"""The MXFP8 exchange: the public function, its checks, and one file per transport."""

from .api import compute_output_splits, to_mxfp8_a2a_dequant
from .copy_engine import CopyEngineTransport
from .nccl import NcclTransport
from .push import PushBuffer, static_transport
from .push_rule import push_unavailable
from .transport import Transport
from .wires import EXCHANGES, WIRE_PRESETS, Wires

__all__ = [
    "EXCHANGES",
    "WIRE_PRESETS",
    "Wires",
    "CopyEngineTransport",
    "NcclTransport",
    "PushBuffer",
    "Transport",
    "compute_output_splits",
    "push_unavailable",
    "static_transport",
    "to_mxfp8_a2a_dequant",
]
