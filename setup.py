"""Build of the one native extension (the kvs128 identity kernel); everything else is in
pyproject.toml. The kernel is plain C99 with no dependencies beyond Python's headers."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvsched._kvs128",
            sources=["src/kvsched/_kvs128.c"],
            extra_compile_args=["-O3", "-std=c99"],
        )
    ]
)
