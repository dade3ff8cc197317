"""Memory tools: counting what autograd keeps for backward, and two ways to keep less
(docs/design.md, "Memory accounting").

"Activation memory" is the bytes of the distinct storages that autograd keeps for backward.
It is counted with ``torch.autograd.graph.saved_tensors_hooks`` while the forward runs and
de-duplicated by storage, so a tensor saved by two consecutive layers (InPlace-ABN's output and
the next convolution's input) counts once. The figure is exact and the same on every device.

- ``iabn.memory.saved``: that count (the functions below are imported from it);
- ``iabn.memory.offloading``: moving saved activations to host memory (``iabn.OffloadModel``,
  ``iabn.offload``, ``iabn.Offloader``);
- ``iabn.memory.bn_act_conv``: norm -> activation -> convolution with the paper's
  checkpointing strategies (``iabn.BNActConv``).

Importing this package imports the counting alone (torch and nothing else of iabn); the other
two load when used, since ``bn_act_conv`` imports the layers.
"""

# __all__ is the API page's list; the names imported "as" themselves are the hook and its
# helpers, for the converter, the planner and the tools
from .saved import SavedCallback as SavedCallback
from .saved import SavedStorage, compiled_saved_bytes, saved_storages, saved_tensor_bytes
from .saved import attributing_saves as attributing_saves
from .saved import counting_saves as counting_saves
from .saved import state_keys as state_keys
from .saved import storage_key as storage_key

__all__ = ["SavedStorage", "compiled_saved_bytes", "saved_storages", "saved_tensor_bytes"]
