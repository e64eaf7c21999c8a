"""Writes the held-out texts of results/twilight_bases_4k.md: Jane Austen's novels (public domain; packaged under
the MIT licence as the R data package janeaustenr) from Debian's `r-cran-janeaustenr_1.0.0-1_all.deb`.

    apt-get download r-cran-janeaustenr      # sha256 df6bddf211906d1ff404f8ff662c21b34e6660e7f54a311084e749050c019c95
    dpkg-deb -x r-cran-janeaustenr_1.0.0-1_all.deb pkg
    python scripts/heldout_literature_text.py pkg/usr/lib/R/site-library/janeaustenr/data OUT_DIR

writes OUT_DIR/<novel>.txt, one paragraph per line pair (the package's hard-wrapped lines joined), e.g.
persuasion.txt (sha256 5822e368...bf43d) and emma.txt (28fdad64...497a0).

The package keeps each novel as an R character vector (one line each) in R's lazy-load database (data/Rdata.rdx:
the gzip-compressed index, data/Rdata.rdb: zlib-compressed objects in R's XDR serialization); this reads just the
parts of that format the package uses.
"""

from __future__ import annotations

import gzip
import struct
import sys
import zlib
from pathlib import Path

NOVELS = (
    "emma",
    "mansfield_park",
    "northanger_abbey",
    "persuasion",
    "pride_and_prejudice",
    "sense_and_sensibility",
)
NIL, CHARSXP, LGLSXP, STRSXP, INTSXP, VECSXP = 254, 9, 10, 16, 13, 19


class Unserializer:
    """R XDR serialization (format 2 or 3) of vectors of strings, ints, logicals and lists; attributes are skipped."""

    def __init__(self, data: bytes):
        if data[:2] != b"X\n":
            raise ValueError("not an XDR serialization")
        self.data, self.pos = data, 2
        version = self.int()
        self.int(), self.int()  # R version that wrote it, oldest R that reads it
        if version == 3:
            length = self.int()  # of the native encoding's name, which follows
            self.pos += length

    def int(self) -> int:
        (value,) = struct.unpack_from(">i", self.data, self.pos)
        self.pos += 4
        return value

    def item(self):
        flags = self.int()
        kind, has_attributes = flags & 0xFF, flags & (1 << 9)
        if kind == NIL:
            return None
        if kind == CHARSXP:
            n = self.int()
            if n == -1:
                return None  # NA_character_
            text = self.data[self.pos : self.pos + n].decode("utf-8")
            self.pos += n
            return text
        if kind in (STRSXP, VECSXP):
            value = [self.item() for _ in range(self.int())]
        elif kind in (INTSXP, LGLSXP):
            n = self.int()
            value = list(struct.unpack_from(f">{n}i", self.data, self.pos))
            self.pos += 4 * n
        else:
            raise ValueError(f"unsupported R type {kind}")
        if has_attributes:
            self.skip_pairlist()
        return value

    def skip_pairlist(self) -> None:
        flags = self.int()
        while flags & 0xFF == 2:  # LISTSXP: [attributes] [tag] value, then the next cell
            if flags & (1 << 9):
                self.skip_pairlist()
            if flags & (1 << 10):
                self.tag()
            self.item()
            flags = self.int()

    def tag(self) -> None:
        flags = self.int()
        if flags & 0xFF == 1:  # SYMSXP: its name
            self.item()
        elif flags & 0xFF != 255:  # anything but a reference to an earlier symbol
            raise ValueError("unsupported tag")
        elif flags >> 8 == 0:
            self.int()


def paragraphs(lines: list[str | None]) -> str:
    out, current = [], []
    for line in lines:
        line = (line or "").strip()
        if line:
            current.append(line)
        elif current:
            out.append(" ".join(current))
            current = []
    if current:
        out.append(" ".join(current))
    return "\n\n".join(out) + "\n"


def main(data_dir: str, out_dir: str) -> None:
    data, out = Path(data_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    index = Unserializer(gzip.decompress((data / "Rdata.rdx").read_bytes())).item()
    database = (data / "Rdata.rdb").read_bytes()
    # index[0]: one (offset, length) per object, in the order of the package's (sorted) names
    for name, (offset, length) in zip(NOVELS, index[0], strict=True):
        blob = database[offset : offset + length]  # 4-byte length, then the zlib stream
        lines = Unserializer(zlib.decompress(blob[4:])).item()
        (out / f"{name}.txt").write_text(paragraphs(lines), encoding="utf-8")
        print(out / f"{name}.txt")


if __name__ == "__main__":
    main(*sys.argv[1:3])
