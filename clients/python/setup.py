"""Builds the package with its protobuf messages generated from the repository's proto/.

The `.proto` file is the one source of truth: `sandbox_pb2.py` and its `.pyi` are written into
the build by grpcio-tools and never checked in, so they cannot drift from `proto/`. The
directory holding `sandbox/v1/sandbox.proto` is `$SANDBOXD_PROTO_DIR`, else `../../proto` (this
package inside the repository), else `./proto` (an sdist that carries a copy).
"""

from __future__ import annotations

import os
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
PROTO = Path("sandbox/v1/sandbox.proto")
# Messages land in sandboxd/_proto/sandbox/v1/ and import each other by that package path.
VIRTUAL_ROOT = "sandboxd/_proto"


def proto_dir() -> Path:
    candidates = [os.environ.get("SANDBOXD_PROTO_DIR"), HERE.parent.parent / "proto", HERE / "proto"]
    for candidate in candidates:
        if candidate and (Path(candidate) / PROTO).is_file():
            return Path(candidate)
    tried = ", ".join(str(c) for c in candidates if c)
    raise SystemExit(f"sandboxd: cannot find {PROTO} (tried {tried}); set SANDBOXD_PROTO_DIR")


def generate(out: Path) -> None:
    """Runs protoc (from grpcio-tools) on sandbox.proto, writing .py and .pyi under `out`."""
    import grpc_tools
    from grpc_tools import protoc

    src = proto_dir()
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    out.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{VIRTUAL_ROOT}={src}",
        f"-I{well_known}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        str(src / PROTO),
    ]
    if protoc.main(args) != 0:
        raise SystemExit(f"sandboxd: protoc failed on {src / PROTO}")
    package = out / VIRTUAL_ROOT
    for sub in ["", "sandbox", "sandbox/v1"]:
        init = package / sub / "__init__.py"
        if not init.exists():
            init.write_text("")


class BuildWithProto(build_py):
    def run(self) -> None:
        generate(Path(self.build_lib))
        super().run()


def dependencies() -> list[str]:
    # Generated code refuses an older protobuf runtime than its generator: ask for at least it.
    try:
        from google.protobuf import __version__ as protobuf_version
    except ImportError:
        protobuf_version = "5.26.0"
    return ["grpcio>=1.62", f"protobuf>={protobuf_version}"]


setup(cmdclass={"build_py": BuildWithProto}, install_requires=dependencies())
