"""Images: read-only EROFS layers (content-addressed), an SQLite registry, and one
file-backed EROFS mount per layer per node. An image is an ordered list of layers, base first.
"""

from .builtin import BUILTIN_IMAGES, ensure_builtin
from .mounts import LayerMounts
from .progress import Progress, rich_progress
from .service import ImageService
from .store import image_digest

__all__ = ["BUILTIN_IMAGES", "ImageService", "LayerMounts", "Progress", "ensure_builtin",
           "image_digest", "rich_progress"]
