"""Lightning integration (NVRx's ``nvidia_resiliency_ext.ptl_resiliency``): ``FaultToleranceCallback``.

Optional: it needs Lightning (``pip install 'nvrx[lightning]'``; ``lightning`` or the older
``pytorch_lightning`` package). Importing this package without either raises ImportError with that
install line, so the rest of nvrx never depends on Lightning.

``StragglerDetectionCallback`` (NVRx's straggler detection) is not available: nvrx has no straggler
detector yet.
"""

from launcher.rank.ptl_resiliency._lightning import Callback, flavor  # raises the ImportError first
from launcher.rank.ptl_resiliency.fault_tolerance_callback import FaultToleranceCallback
from launcher.rank.ptl_resiliency.simulated_fault import SimulatedFaultParams

__all__ = ["Callback", "FaultToleranceCallback", "SimulatedFaultParams", "flavor"]
