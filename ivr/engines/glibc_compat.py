"""Make llama-cpp-py-sync's prebuilt libraries load on glibc older than 2.38.

The PyPI wheel is tagged manylinux2014 but was linked on glibc 2.38, and the only
2.38 symbols it uses are the C23 parsing functions (`__isoc23_strtol`, `strtoul`,
`strtoull`, `sscanf`). They behave like the classic functions apart from accepting
`0b` binary literals, which llama.cpp never parses. So instead of compiling
llama.cpp (about 10 minutes on 2 cores) we copy the libraries to a cache folder
and rebind those imports to the classic glibc 2.2.5 symbols. The installed
package is never modified.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

_C23_PREFIX = b"__isoc23_"
_NEW_GLIBC = b"GLIBC_2.38"
_BASE_GLIBC = b"GLIBC_2.2.5"
_VER_FLG_WEAK = 0x2
_SHT_DYNSYM = 11
_SHT_GNU_VERNEED = 0x6FFFFFFE
_SHT_GNU_VERSYM = 0x6FFFFFFF
_PATCHED_MARKER = ".ivr-glibc-compat"


class ElfPatchError(RuntimeError):
    """The library uses glibc 2.38 in a way this shim does not understand."""


@dataclass(frozen=True, slots=True)
class _Section:
    kind: int
    offset: int
    size: int
    link: int
    entsize: int


def glibc_version() -> tuple[int, int] | None:
    """The running glibc's (major, minor), or None on a non-glibc system."""
    try:
        text = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (ValueError, OSError):
        return None
    parts = text.removeprefix("glibc ").split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def needs_patch() -> bool:
    version = glibc_version()
    return version is not None and version < (2, 38)


def compat_library_dir(source_dir: Path, cache_dir: Path) -> Path:
    """Return a folder with loadable copies of the `*.so*` files in source_dir.

    The copies are made once per source folder and reused afterwards.
    """
    target = cache_dir / _cache_key(source_dir)
    if (target / _PATCHED_MARKER).exists():
        return target
    staging = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for library in sorted(source_dir.glob("*.so*")):
        copy = staging / library.name
        shutil.copy2(library, copy)
        patch_library(copy)
    (staging / _PATCHED_MARKER).write_text(str(source_dir))
    try:
        staging.rename(target)
    except OSError:  # another process finished first; its copy is identical
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _cache_key(source_dir: Path) -> str:
    # Stable across processes; a reinstall changes the files' mtimes and so the key.
    libraries = sorted(source_dir.glob("*.so*"))
    stamp = ";".join(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in libraries)
    digest = hashlib.sha256(f"{source_dir.resolve()}|{stamp}".encode()).hexdigest()[:16]
    return f"{source_dir.name}-{digest}"


def patch_library(path: Path) -> int:
    """Rebind C23 glibc imports in one ELF file in place; return how many."""
    data = bytearray(path.read_bytes())
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ElfPatchError(f"{path}: not a 64-bit little-endian ELF file")
    sections = _sections(data)
    dynsym = _only(sections, _SHT_DYNSYM, path)
    versym = _only(sections, _SHT_GNU_VERSYM, path)
    verneed = _only(sections, _SHT_GNU_VERNEED, path)
    dynstr = sections[dynsym.link]
    new_index, base_index = _weaken_new_glibc(data, verneed, dynstr, path)
    if new_index is None:
        return 0
    count = _rebind_symbols(data, dynsym, versym, dynstr, new_index, base_index, path)
    path.write_bytes(bytes(data))
    return count


def _sections(data: bytearray) -> list[_Section]:
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    result = []
    for i in range(shnum):
        base = shoff + i * shentsize
        (kind,) = struct.unpack_from("<I", data, base + 4)
        offset, size, link = struct.unpack_from("<QQI", data, base + 0x18)
        (entsize,) = struct.unpack_from("<Q", data, base + 0x38)
        result.append(_Section(kind, offset, size, link, entsize))
    return result


def _only(sections: list[_Section], kind: int, path: Path) -> _Section:
    found = [s for s in sections if s.kind == kind]
    if len(found) != 1:
        raise ElfPatchError(f"{path}: expected one section of type {kind:#x}, found {len(found)}")
    return found[0]


def _cstr(data: bytearray, table: _Section, offset: int) -> bytes:
    start = table.offset + offset
    return bytes(data[start : data.index(0, start)])


def _weaken_new_glibc(
    data: bytearray, verneed: _Section, dynstr: _Section, path: Path
) -> tuple[int | None, int | None]:
    """Mark the GLIBC_2.38 requirement weak; return its and GLIBC_2.2.5's index."""
    new_index = base_index = None
    entry = verneed.offset
    while True:
        _, count, file_name, aux, next_entry = struct.unpack_from("<HHIII", data, entry)
        is_libc = _cstr(data, dynstr, file_name) == b"libc.so.6"
        aux_at = entry + aux
        for _ in range(count):
            _, flags, other, name, next_aux = struct.unpack_from("<IHHII", data, aux_at)
            version = _cstr(data, dynstr, name)
            if is_libc and version == _NEW_GLIBC:
                new_index = other
                struct.pack_into("<H", data, aux_at + 4, flags | _VER_FLG_WEAK)
            elif is_libc and version == _BASE_GLIBC:
                base_index = other
            aux_at += next_aux
        if not next_entry:
            break
        entry += next_entry
    if new_index is not None and base_index is None:
        raise ElfPatchError(f"{path}: needs GLIBC_2.38 but has no GLIBC_2.2.5 to rebind to")
    return new_index, base_index


def _rebind_symbols(
    data: bytearray,
    dynsym: _Section,
    versym: _Section,
    dynstr: _Section,
    new_index: int,
    base_index: int | None,
    path: Path,
) -> int:
    count = 0
    for i in range(dynsym.size // dynsym.entsize):
        version_at = versym.offset + 2 * i
        (version,) = struct.unpack_from("<H", data, version_at)
        if version & 0x7FFF != new_index:
            continue
        symbol_at = dynsym.offset + i * dynsym.entsize
        (name_offset,) = struct.unpack_from("<I", data, symbol_at)
        name = _cstr(data, dynstr, name_offset)
        if not name.startswith(_C23_PREFIX) or base_index is None:
            raise ElfPatchError(f"{path}: unsupported GLIBC_2.38 symbol {name.decode()!r}")
        # The classic name is the tail of the C23 one, already in the string table.
        struct.pack_into("<I", data, symbol_at, name_offset + len(_C23_PREFIX))
        struct.pack_into("<H", data, version_at, base_index)
        count += 1
    return count
