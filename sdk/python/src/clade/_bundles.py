"""A function's code as the server takes it: a tar.gz. Made here from a
directory (its contents at the bundle's root, without what a build or a
tool left beside the code) or from one file; a `.tar.gz` / `.tgz` file,
or bytes, is sent as it is."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path
from typing import Union

#: Directories never put in a bundle: installed dependencies, caches,
#: build outputs and version control, which the deploy makes anew or
#: does not need.
SKIPPED = frozenset({"node_modules", "__pycache__", ".git", ".venv", "venv", "dist", ".next", ".turbo"})

BundleSource = Union[str, "os.PathLike[str]", bytes, bytearray, memoryview]


def function_bundle(source: BundleSource) -> bytes:
    """The tar.gz of `source`: bytes as given, a `.tar.gz` / `.tgz` file as
    it is, a directory's files (under their paths relative to it, skipping
    `SKIPPED` directories), or one other file (under its own name)."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source)
    path = Path(source)
    if path.is_file() and path.name.endswith((".tar.gz", ".tgz")):
        return path.read_bytes()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", dereference=True) as tar:
        if path.is_dir():
            _add_directory(tar, path)
        elif path.is_file():
            tar.add(path, arcname=path.name, recursive=False)
        else:
            raise FileNotFoundError(f"no file or directory at {path}")
    return buffer.getvalue()


def _add_directory(tar: tarfile.TarFile, root: Path) -> None:
    for directory, subdirectories, files in os.walk(root):
        subdirectories[:] = sorted(name for name in subdirectories if name not in SKIPPED)
        here = Path(directory)
        for name in subdirectories:
            if (here / name).is_symlink():
                # os.walk does not follow it, and a bundle holds files and directories only.
                raise ValueError(f"{here / name} is a symbolic link to a directory: put the directory itself in the code")
            tar.add(here / name, arcname=(here / name).relative_to(root).as_posix(), recursive=False)
        for name in sorted(files):
            # A link to a file goes in as the file (`dereference`).
            tar.add(here / name, arcname=(here / name).relative_to(root).as_posix(), recursive=False)
