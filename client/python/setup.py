"""Build hook of the kvcd Python package.

At build time (wheel or in-tree install from the kvcd checkout) this:
  * reads the version from the top-level CMakeLists.txt (`project(kvcd VERSION x.y.z)`),
  * generates the protobuf/gRPC stubs of proto/kvcd/v1/kvcache.proto (as kvcd.v1) and the
    messages of proto/grpc/health/v1/health.proto (as kvcd._health) with grpcio-tools,
  * pins the runtime `protobuf` to at least the version of the generated code (protobuf
    refuses to load generated code newer than its runtime).
Everything else is ordinary setuptools metadata from pyproject.toml.
"""
import re
import shutil
import tempfile
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


def _version() -> str:
    cmake = REPO / "CMakeLists.txt"
    if cmake.is_file():
        m = re.search(r"project\s*\(\s*kvcd\s+VERSION\s+([0-9][0-9.]*)", cmake.read_text())
        if m:
            return m.group(1)
    pkg_info = HERE / "PKG-INFO"  # building from an sdist made by this file
    if pkg_info.is_file():
        m = re.search(r"^Version:\s*(\S+)", pkg_info.read_text(), re.M)
        if m:
            return m.group(1)
    raise RuntimeError(f"cannot find the kvcd version: no {cmake} with project(kvcd VERSION ...)")


def _generate(out_root: Path) -> str:
    """Generates the stubs under out_root/kvcd; returns (protobuf, grpcio) run-time floors."""
    from grpc_tools import protoc  # build requirement
    import grpc_tools

    proto_root = REPO / "proto"
    kvcd_proto = proto_root / "kvcd" / "v1" / "kvcache.proto"
    health_proto = proto_root / "grpc" / "health" / "v1" / "health.proto"
    if not kvcd_proto.is_file():
        raise RuntimeError(f"{kvcd_proto} not found: build the kvcd package from the kvcd checkout")
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    args = ["grpc_tools.protoc", f"-I{proto_root}", f"-I{include}", f"--python_out={out_root}",
            f"--pyi_out={out_root}", f"--grpc_python_out={out_root}", str(kvcd_proto)]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed on " + str(kvcd_proto))
    # grpc/health/v1 would land in a top-level `grpc` package and shadow grpcio: generate it
    # elsewhere and keep only the messages (kvcd calls the two methods by name).
    with tempfile.TemporaryDirectory() as tmp:
        if protoc.main(["grpc_tools.protoc", f"-I{proto_root}", f"--python_out={tmp}",
                        f"--pyi_out={tmp}", str(health_proto)]) != 0:
            raise RuntimeError("protoc failed on " + str(health_proto))
        dst = out_root / "kvcd" / "_health"
        dst.mkdir(parents=True, exist_ok=True)
        for name in ("health_pb2.py", "health_pb2.pyi"):
            shutil.copy(Path(tmp) / "grpc" / "health" / "v1" / name, dst / name)
        (dst / "__init__.py").write_text('"""Generated grpc.health.v1 messages."""\n')
    (out_root / "kvcd" / "v1" / "__init__.py").write_text('"""Generated kvcd.v1 stubs."""\n')
    return _gencode_floors(out_root)


def _gencode_floors(out_root: Path):
    """(protobuf, grpcio) versions the generated code needs at run time: protobuf refuses
    gencode newer than its runtime, and the gRPC stubs refuse an older grpcio."""
    pb2 = (out_root / "kvcd" / "v1" / "kvcache_pb2.py").read_text()
    m = re.search(r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*"
                  r"(\d+),\s*(\d+),\s*(\d+)", pb2)
    protobuf = ".".join(m.groups()) if m else "4.21.0"  # older gencode: the builder API (4.21+)
    grpc_stub = (out_root / "kvcd" / "v1" / "kvcache_pb2_grpc.py").read_text()
    m = re.search(r"GRPC_GENERATED_VERSION\s*=\s*'([0-9.]+)'", grpc_stub)
    grpcio = m.group(1) if m else "1.60.0"
    return protobuf, grpcio


class BuildPyWithStubs(build_py):
    def run(self):
        super().run()
        out = Path(self.build_lib)
        protobuf, grpcio = _generate(out)
        (out / "kvcd" / "_version.py").write_text(
            f'__version__ = "{_version()}"\n__protobuf_gencode__ = "{protobuf}"\n'
            f'__grpc_generated__ = "{grpcio}"\n')


def _gencode_floors_now():
    with tempfile.TemporaryDirectory() as tmp:
        return _generate(Path(tmp))


_PROTOBUF, _GRPCIO = _gencode_floors_now()
setup(
    version=_version(),
    install_requires=[f"grpcio>={_GRPCIO}", f"protobuf>={_PROTOBUF}", "numpy>=1.22"],
    cmdclass={"build_py": BuildPyWithStubs},
)
