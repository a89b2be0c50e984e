"""Build hook of the kvcd Python package.

At build time (wheel or in-tree install from the kvcd checkout) this:
  * reads the version from the top-level CMakeLists.txt (`project(kvcd VERSION x.y.z)`),
  * generates the protobuf/gRPC stubs of proto/kvcd/v1/kvcache.proto (as kvcd.v1) and the
    messages of proto/grpc/health/v1/health.proto (as kvcd._health) with grpcio-tools,
  * declares fixed runtime floors (RUNTIME_FLOORS) and checks that the generated code needs
    no newer runtime (protobuf refuses generated code newer than its runtime, and newer gRPC
    stubs refuse an older grpcio): the build fails rather than silently raising the floors
    when another grpcio-tools than pyproject's pinned one is used.
An sdist carries the two .proto files under proto/, so it builds without the checkout.
Everything else is ordinary setuptools metadata from pyproject.toml.
"""
import re
import shutil
import tempfile
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
PROTOS = ("kvcd/v1/kvcache.proto", "grpc/health/v1/health.proto")
# The oldest runtimes the client is tested with (scripts/test-python.sh's floor environment).
RUNTIME_FLOORS = {"protobuf": "4.25.1", "grpcio": "1.62.0", "numpy": "1.23.5"}


def _proto_root() -> Path:
    """proto/ of an unpacked sdist, else the checkout's proto/."""
    return HERE / "proto" if (HERE / "proto" / PROTOS[0]).is_file() else REPO / "proto"


def _newer(a: str, b: str) -> bool:
    return tuple(int(x) for x in a.split(".")) > tuple(int(x) for x in b.split("."))


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
    """Generates the stubs under out_root/kvcd and checks them against RUNTIME_FLOORS."""
    from grpc_tools import protoc  # build requirement
    import grpc_tools

    proto_root = _proto_root()
    kvcd_proto = proto_root / "kvcd" / "v1" / "kvcache.proto"
    health_proto = proto_root / "grpc" / "health" / "v1" / "health.proto"
    if not kvcd_proto.is_file():
        raise RuntimeError(f"{kvcd_proto} not found: build the kvcd package from the kvcd "
                           f"checkout or from its sdist")
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
    protobuf, grpcio = _gencode_floors(out_root)
    for name, needed in (("protobuf", protobuf), ("grpcio", grpcio)):
        if _newer(needed, RUNTIME_FLOORS[name]):
            raise RuntimeError(
                f"the generated code needs {name}>={needed}, above the declared floor "
                f"{RUNTIME_FLOORS[name]}: build with pyproject's pinned grpcio-tools "
                f"(pip builds in an isolated environment by default) or raise RUNTIME_FLOORS")


def _gencode_floors(out_root: Path):
    """(protobuf, grpcio) versions the generated code needs at run time: protobuf refuses
    gencode newer than its runtime, and the gRPC stubs refuse an older grpcio."""
    pb2 = (out_root / "kvcd" / "v1" / "kvcache_pb2.py").read_text()
    m = re.search(r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*"
                  r"(\d+),\s*(\d+),\s*(\d+)", pb2)
    if m:
        protobuf = ".".join(m.groups())
    else:  # older gencode carries its version in a comment
        m = re.search(r"# Protobuf Python Version: ([0-9.]+)", pb2)
        protobuf = m.group(1) if m else "0"
    grpc_stub = (out_root / "kvcd" / "v1" / "kvcache_pb2_grpc.py").read_text()
    m = re.search(r"GRPC_GENERATED_VERSION\s*=\s*'([0-9.]+)'", grpc_stub)
    grpcio = m.group(1) if m else "0"  # stubs before 1.63 check no version
    return protobuf, grpcio


class BuildPyWithStubs(build_py):
    def run(self):
        super().run()
        out = Path(self.build_lib)
        _generate(out)
        (out / "kvcd" / "_version.py").write_text(
            f'__version__ = "{_version()}"\n'
            f'__runtime_floors__ = {RUNTIME_FLOORS!r}\n')


class SdistWithProtos(sdist):
    """Adds the .proto files under proto/ so that the sdist builds on its own."""

    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        for rel in PROTOS:
            dst = Path(base_dir) / "proto" / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(_proto_root() / rel, dst)


setup(
    version=_version(),
    install_requires=[f"{name}>={v}" for name, v in RUNTIME_FLOORS.items()],
    cmdclass={"build_py": BuildPyWithStubs, "sdist": SdistWithProtos},
)
