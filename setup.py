"""Builds the C extension ``shmshare._native``; everything else lives in pyproject.toml."""
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "shmshare._native",
            sources=["native/shmshare_native.c", "native/lease.c"],
            depends=["native/shmshare_native.h", "native/lease.h"],
            include_dirs=["native"],
            extra_compile_args=["-std=c11", "-O2", "-Wall", "-Wextra", "-Werror",
                                "-Wno-missing-field-initializers", "-D_GNU_SOURCE"],
            extra_link_args=["-pthread"],
        )
    ]
)
