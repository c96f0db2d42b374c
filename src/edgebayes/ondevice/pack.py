"""The runner as one file: this package zipped as a zipapp (PEP 441), run with `python runner.pyz ...`.

Export writes it into the bundle, where the manifest hashes it like the model, so the measuring code is
fixed at export: an edit of the source afterwards does not change an exported bundle's runner. The archive
is deterministic (files in sorted order, one fixed timestamp and mode), so that exporting again gives the
same bytes and the export stage's outputs hash the same.
"""

import io
import zipapp
import zipfile
from pathlib import Path

PACKAGE = "ondevice"   # the package's name inside the archive; its modules import each other relatively
MAIN = "import sys\n\nfrom ondevice.cli import main\n\nsys.exit(main())\n"
_EPOCH = (1980, 1, 1, 0, 0, 0)   # the earliest time a zip entry can hold


def _entry(name):
    info = zipfile.ZipInfo(name, date_time=_EPOCH)
    info.compress_type = zipfile.ZIP_DEFLATED
    info.external_attr = 0o644 << 16
    return info


def write_runner(path, interpreter="/usr/bin/env python3"):
    """Write the zipapp of this package to `path`; returns the path."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr(_entry("__main__.py"), MAIN)
        for module in sorted(Path(__file__).parent.glob("*.py")):
            archive.writestr(_entry(f"{PACKAGE}/{module.name}"), module.read_bytes())
    buffer.seek(0)
    zipapp.create_archive(buffer, path, interpreter=interpreter)
    return Path(path)
