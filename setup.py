"""Installs ``fullshard-install.pth`` into site-packages beside the package (a regular and an
editable install alike): with ``FULLSHARD_INSTALL=1`` it turns on fullshard's install switch
at interpreter start, in every process (see [Note: the install switch] in
``fullshard/_install.py``). Everything else is in ``pyproject.toml``."""

from __future__ import annotations

import os
import shutil
from typing import Any

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "fullshard-install.pth"


class BuildPyWithPth(build_py):
    """A regular install: the .pth at the root of the wheel (site-packages)."""

    def run(self) -> None:
        super().run()
        shutil.copy(PTH, os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


cmdclass: dict[str, Any] = {"build_py": BuildPyWithPth}

try:
    from setuptools.command.editable_wheel import editable_wheel
except ImportError:  # setuptools < 64: no PEP 660 editable installs
    editable_wheel = None

if editable_wheel is not None and hasattr(editable_wheel, "_select_strategy"):

    class _WithPth:
        """An editable install's strategy, which also writes the .pth into the wheel."""

        def __init__(self, strategy: Any) -> None:
            self._strategy = strategy

        def __call__(self, wheel: Any, files: Any, mapping: Any) -> None:
            self._strategy(wheel, files, mapping)
            with open(PTH, "rb") as file:
                wheel.writestr(PTH, file.read())

        def __enter__(self) -> _WithPth:
            self._strategy.__enter__()
            return self

        def __exit__(self, *exc: Any) -> Any:
            return self._strategy.__exit__(*exc)

    class EditableWheelWithPth(editable_wheel):
        def _select_strategy(self, name: str, tag: str, build_lib: Any) -> Any:
            return _WithPth(super()._select_strategy(name, tag, build_lib))

    cmdclass["editable_wheel"] = EditableWheelWithPth

setup(cmdclass=cmdclass)
