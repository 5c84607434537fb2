"""loader: a drop-in `torch.utils.data.DataLoader` that plans every epoch's reads, caches
raw sample bytes in shared memory / local disk (Belady placement), and prefetches in
exact order."""

from loader.dataloader import DataLoader
from loader.errors import SampleError
from loader.file_dataset import FileDataset
from loader.sizes import parse_size

__all__ = ["DataLoader", "FileDataset", "SampleError", "parse_size"]
