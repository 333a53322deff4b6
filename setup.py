"""Build hook: the wire's Python code (``proto/epd/**/*_pb2*.py``, never committed) is generated from the
``.proto`` files by grpc_tools.protoc whenever setuptools builds the package, so ``pip install .`` from a clean
clone (or an sdist, or ``pip install -e .``) has it. Everything else about the package is in pyproject.toml;
grpcio-tools is a build requirement there."""

from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PROTO_ROOT = Path(__file__).resolve().parent / "proto"


def generate_protos() -> list[Path]:
    """Run protoc over every .proto under proto/ (Python messages, gRPC stubs, type stubs) next to it.
    Returns the .proto files compiled. Raises RuntimeError naming the file protoc refused."""
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted(PROTO_ROOT.rglob("*.proto"))
    include = str(Path(grpc_tools.__file__).resolve().parent / "_proto")  # google/protobuf/*.proto
    for proto in protos:
        args = ["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={PROTO_ROOT}",
                f"--grpc_python_out={PROTO_ROOT}", f"--pyi_out={PROTO_ROOT}", str(proto)]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {proto}")
    return protos


class BuildPyWithProtos(build_py):
    def run(self) -> None:
        generate_protos()
        super().run()


setup(cmdclass={"build_py": BuildPyWithProtos})
