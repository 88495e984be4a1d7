"""Run a lesson on the package as the course stands at the end of that lesson.

Every numbered lesson starts with

    from course_stage import use_course_stage
    use_course_stage("09")

before it imports `nanovllm_edu`. The package in the repository holds what every lesson wrote; lesson 09 should not
see what 12, 13 or 15 later change in the classes it grows (a runner that 15 hands its ranks, say). So this puts
`.stages/09/` first on `sys.path`: the package composed from lessons 00-09 only, by the exporter's own rules
(`python scripts/export_notebooks.py --stage 09`, under a second, rebuilt only when one of those notebooks
changed). Child processes (tensor-parallel workers, a server started with `python -m`) inherit it.

An install without the course's notebooks (a wheel) has nothing to compose: the lesson then runs on the
package as installed, and says so.
"""
import importlib.util
import os
import sys
from pathlib import Path


def course_root() -> Path | None:
    """The checkout the package was installed from (editable), if it has the course's exporter."""
    spec = importlib.util.find_spec("nanovllm_edu")  # locates the package without importing it
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("nanovllm_edu is not installed; run the README's first command")
    root = Path(spec.origin).resolve().parents[1]
    if root.parent.name == ".stages":  # this kernel already uses a stage: .stages/NN/nanovllm_edu
        root = root.parents[1]
    return root if (root / "scripts" / "export_notebooks.py").exists() else None


def use_course_stage(lesson: str) -> None:
    """Make `import nanovllm_edu` load the package as lessons 00 to `lesson` write it."""
    root = course_root()
    if root is None:
        print(f"nanovllm_edu: this install has no notebooks to compose; lesson {lesson} runs on the whole package")
        return
    sys.path.insert(0, str(root / "scripts"))
    try:
        from export_notebooks import stage_package
    finally:
        sys.path.remove(str(root / "scripts"))
    stage = stage_package(root, lesson)
    loaded = sys.modules.get("nanovllm_edu")
    if loaded is not None and Path(loaded.__file__).resolve().parents[1] != stage.resolve():
        raise RuntimeError(f"this kernel already imported nanovllm_edu from {Path(loaded.__file__).parent}; "
                           f"restart the kernel and run the lesson from the top, so that lesson {lesson} uses its stage")
    if str(stage) not in sys.path:
        sys.path.insert(0, str(stage))
        os.environ["PYTHONPATH"] = os.pathsep.join([str(stage), *filter(None, [os.environ.get("PYTHONPATH")])])
    print("nanovllm_edu: the package as " + ("lesson 00 writes it" if lesson == "00" else f"lessons 00-{lesson} write it"))
