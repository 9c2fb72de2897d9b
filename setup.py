"""Builds the C extension ``shmshare._native`` and sets the license; everything else lives in pyproject.toml."""
import setuptools
from setuptools import Extension, setup

LICENSE = "BSD-3-Clause"  # an SPDX expression


def _license() -> dict[str, str]:
    """Return the license as this setuptools takes it, without a deprecation in either.

    setuptools >= 77 takes an SPDX ``license_expression`` (core metadata 2.4,
    ``License-Expression``) and deprecates the old ``project.license`` table;
    older ones (an offline ``pip install --no-build-isolation`` uses the one
    installed) reject the SPDX string in pyproject.toml and take ``license``
    (``License:``). So pyproject.toml lists ``license`` as dynamic and it is set here.
    """
    if int(setuptools.__version__.split(".")[0]) >= 77:
        return {"license_expression": LICENSE}
    return {"license": LICENSE}


setup(
    **_license(),
    ext_modules=[
        Extension(
            "shmshare._native",
            sources=["native/shmshare_native.c", "native/lease.c", "native/ring.c", "native/counts.c",
                     "native/strhash.c"],
            depends=["native/shmshare_native.h", "native/lease.h", "native/ring.h", "native/counts.h",
                     "native/strhash.h"],
            include_dirs=["native"],
            extra_compile_args=["-std=c11", "-O2", "-Wall", "-Wextra", "-Werror",
                                "-Wno-missing-field-initializers", "-D_GNU_SOURCE"],
            extra_link_args=["-pthread"],
        )
    ]
)
