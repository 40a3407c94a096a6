"""Where parameter values come from: initializers, weights files, the per-module sources, and the marks
TP puts on parameters.

- ``init``: layout-independent initializers (any range of a parameter, drawn on its own).
- ``files``: pretrained weights streamed from a file or a save_pretrained directory, range by range.
- ``hf_keys``: a transformers model's checkpoint keys as transformers loads and saves them (its renames).
- ``sources``: every parameter's and buffer's values, one module at a time (``hybrid.materialize``).
- ``attrs``: the marks TP layers set on parameters and the ZeRO engine reads.
- ``state_entries``: what a module's ``state_dict()`` holds, and the dtype each entry is exported in.
"""

from hybrid.weights.files import WeightsFile, open_weights

__all__ = ["WeightsFile", "open_weights"]
