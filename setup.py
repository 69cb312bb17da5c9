"""Build step for the optional native pieces of the same-host engine: the streaming-store
copier and copy assist (both share _copy_kernels.h and _int_args.h).

Everything else is in pyproject.toml. ``optional=True``: where no C compiler is present the
install still succeeds; the engine then copies with ``ctypes.memmove`` and writers copy alone
(the engine says which).
"""

from setuptools import Extension, setup

_HERE = "moriio_fsm/engines/same_host/"
_HEADERS = [_HERE + "_copy_kernels.h", _HERE + "_int_args.h"]

setup(
    ext_modules=[
        Extension(
            "moriio_fsm.engines.same_host._stream_copy",
            [_HERE + "_stream_copy.c"],
            depends=_HEADERS,
            extra_compile_args=["-O2"],
            optional=True,
        ),
        Extension(
            "moriio_fsm.engines.same_host._copy_assist",
            [_HERE + "_copy_assist.c"],
            depends=_HEADERS,
            extra_compile_args=["-O2", "-Wall"],
            optional=True,
        ),
    ]
)
