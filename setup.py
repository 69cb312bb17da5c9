"""Build step for the one optional native piece: the streaming-store copier of the same-host engine.

Everything else is in pyproject.toml. ``optional=True``: where no C compiler is present the
install still succeeds and the engine copies with ``ctypes.memmove`` (the engine says which).
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("moriio_fsm.adapters.moriio._stream_copy",
                             ["moriio_fsm/adapters/moriio/_stream_copy.c"],
                             extra_compile_args=["-O2"], optional=True)])
