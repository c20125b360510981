"""Lightning integration (NVRx's ``nvidia_resiliency_ext.ptl_resiliency``): ``FaultToleranceCallback`` and
``StragglerDetectionCallback``.

Optional: it needs Lightning (``pip install 'nvrx[lightning]'``; ``lightning`` or the older
``pytorch_lightning`` package). Importing this package without either raises ImportError with that
install line, so the rest of nvrx never depends on Lightning.

``StragglerDetectionCallback`` runs on ``nvrx.launcher.rank.straggler.Detector`` (CPU wall-clock time of each
``training_step``; nvrx profiles no CUDA kernels, so its "GPU" arguments apply to that section's scores).
"""

from nvrx.launcher.rank.ptl_resiliency._lightning import Callback, flavor  # raises the ImportError first
from nvrx.launcher.rank.ptl_resiliency.fault_tolerance_callback import FaultToleranceCallback
from nvrx.launcher.rank.ptl_resiliency.simulated_fault import SimulatedFaultParams
from nvrx.launcher.rank.ptl_resiliency.straggler_det_callback import StragglerDetectionCallback

__all__ = ["Callback", "FaultToleranceCallback", "SimulatedFaultParams", "StragglerDetectionCallback", "flavor"]
