"""release_pages drops a mapped file's pages from the process (a load's resident set): a tensor smaller than
a page drops the pages around it too (the page cache may map a large folio, up to 2 MiB, on one fault: a
norm of a few KiB otherwise kept that resident to the end of the load), a view of a view finds its mapping,
and a range at the mapping's ends stays inside it."""

from __future__ import annotations

import numpy as np

from runtime.quant.gguf_raw import release_pages


def _mapped_rss(path) -> int:
    """Resident bytes of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:  # a mapping's header line
                inside = len(fields) >= 6 and fields[5] == str(path)
            elif inside and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total


def test_a_small_view_releases_its_neighbourhood_and_a_large_one_all_of_itself(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(np.arange(12 << 20, dtype=np.uint8).tobytes())
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    norm = mapped[(5 << 20) + 1000 : (5 << 20) + 1000 + 2560]  # 2.5 KB inside a page, as a norm
    assert int(norm[0]) == ((5 << 20) + 1000) % 256  # read: mapped
    assert _mapped_rss(path) >= 4096
    release_pages(norm)
    assert _mapped_rss(path) == 0
    # the whole mapping, read, then released through a view of a view (the checkpoint's reshape and uint8 view)
    assert int(mapped[::4096].sum()) >= 0
    assert _mapped_rss(path) >= (12 << 20) // 4096 * 4096 // 2
    release_pages(mapped.reshape(12, -1)[3:].view(np.uint8))
    assert _mapped_rss(path) <= (3 << 20) + (2 << 20)  # rows 0-2 and at most the folio before row 3
    release_pages(mapped[: 1 << 20])  # at the mapping's start: the range stays inside it
    release_pages(mapped[-100:])  # and at its end
    assert _mapped_rss(path) == 0
    # the data reads back the same after its pages went
    assert int(mapped[(5 << 20) + 1000]) == ((5 << 20) + 1000) % 256
