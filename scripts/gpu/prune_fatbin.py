"""Drop, in place, every entry of every CUDA fatbin in a shared library that one GPU generation cannot use.

vLLM's kernel library carries cubins for every architecture it supports; the GPU machine is a Hopper
(sm_90), and the payload has to fit the device tool's 64 MiB. Kept in each fatbin: the cubins (ELF) built
for exactly the given architecture, and PTX for any architecture up to it (the driver compiles PTX for
the device it runs on). Each fatbin is rewritten compacted at its old place with its new size in its
header; the bytes freed at its end become zeros, which compress to nothing. A fatbin with nothing for the
architecture (kernels for other GPUs only) keeps its smallest entry, so it stays a valid, non-empty
fatbin that the CUDA runtime still registers at load time. The ELF layout, the section sizes and every
pointer into ``.nv_fatbin`` stay as they were, so the library loads exactly as before.

    python3 prune_fatbin.py LIBRARY.so [ARCH]      (ARCH: the SM number to keep, default 90)
"""

from __future__ import annotations

import argparse
import struct
from dataclasses import dataclass
from pathlib import Path

FATBIN_MAGIC = 0xBA55ED50
# struct layouts (little-endian): the fatbin wrapper's header, each entry's header, and the ELF64 fields
WRAPPER_HEADER = "<IHHQ"  # magic, version, header size, size of the entries after the header
ENTRY_HEADER = "<HHIQ"  # kind, version, header size, payload size (padded)
ENTRY_ARCH_OFFSET = 28  # the SM number inside an entry's header
ENTRY_KIND_PTX = 1
ENTRY_KIND_CUBIN = 2


@dataclass
class PruneReport:
    fatbins: int = 0
    fatbins_without_arch: int = 0
    bytes_before: int = 0
    bytes_after: int = 0


def section_span(image: bytes | bytearray, wanted: str) -> tuple[int, int]:
    """File offset and size of the ELF64 section named ``wanted``."""
    assert image[:4] == b"\x7fELF" and image[4] == 2, "not a 64-bit ELF file"
    (section_table,) = struct.unpack_from("<Q", image, 0x28)
    entry_size, count, names_index = struct.unpack_from("<HHH", image, 0x3A)

    def header(index: int) -> tuple[int, int, int]:
        base = section_table + index * entry_size
        (name,) = struct.unpack_from("<I", image, base)
        offset, size = struct.unpack_from("<QQ", image, base + 0x18)
        return name, offset, size

    _, names_offset, _ = header(names_index)
    for index in range(count):
        name, offset, size = header(index)
        end = image.index(b"\0", names_offset + name)
        if image[names_offset + name : end].decode() == wanted:
            return offset, size
    raise SystemExit(f"no {wanted} section")


def prune(image: bytearray, arch: int) -> PruneReport:
    report = PruneReport()
    position, section_end = section_span(image, ".nv_fatbin")
    section_end += position
    while position + struct.calcsize(WRAPPER_HEADER) <= section_end:
        magic, _version, header_size, entries_size = struct.unpack_from(WRAPPER_HEADER, image, position)
        if magic != FATBIN_MAGIC:  # padding between fatbins; they start 8-byte aligned
            position += 8
            continue
        report.fatbins += 1
        first, end = position + header_size, position + header_size + entries_size
        entries: list[bytes] = []
        kept: list[bytes] = []
        entry = first
        while entry < end:
            kind, _version, entry_header_size, payload_size = struct.unpack_from(ENTRY_HEADER, image, entry)
            (entry_arch,) = struct.unpack_from("<I", image, entry + ENTRY_ARCH_OFFSET)
            whole = bytes(image[entry : entry + entry_header_size + payload_size])
            entries.append(whole)
            if (kind == ENTRY_KIND_CUBIN and entry_arch == arch) or (
                kind == ENTRY_KIND_PTX and entry_arch <= arch
            ):
                kept.append(whole)
            entry += len(whole)
        assert entry == end, f"the entries overrun the fatbin at {position:#x}"
        if not kept:
            report.fatbins_without_arch += 1
            kept = [min(entries, key=len)]
        compacted = b"".join(kept)
        image[first:end] = compacted + bytes(entries_size - len(compacted))
        struct.pack_into("<Q", image, position + 8, len(compacted))
        report.bytes_before += entries_size
        report.bytes_after += len(compacted)
        position = end
    return report


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("library", type=Path)
    parser.add_argument("arch", type=int, nargs="?", default=90)
    args = parser.parse_args()
    image = bytearray(args.library.read_bytes())
    report = prune(image, args.arch)
    args.library.write_bytes(image)
    print(
        f"{args.library}: {report.fatbins} fatbins ({report.fatbins_without_arch} with nothing for "
        f"sm_{args.arch} cut to one entry), {report.bytes_before / 1e6:.1f} MB -> "
        f"{report.bytes_after / 1e6:.1f} MB kept"
    )


if __name__ == "__main__":
    main()
