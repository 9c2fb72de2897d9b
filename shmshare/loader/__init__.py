"""A worker-pool DataLoader, a drop-in for ``torch.utils.data.DataLoader``.

(Being built for issue 10; see docs/loader.md once it lands.)
"""

from __future__ import annotations
