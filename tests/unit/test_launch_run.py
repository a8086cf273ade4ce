"""launch/run's mpirun command line, with a stand-in mpirun on PATH that reports what it was
given (no MPI job starts): the Open MPI settings it adds, and the allreduce rules file."""
import os
import stat
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN = os.path.join(ROOT, "launch", "run")
RULES = os.path.join(ROOT, "launch", "ompi-allreduce-rules")


def fake_mpirun(tmp_path, version):
    """A directory holding an 'mpirun' that prints ``version`` for --version and otherwise
    its arguments, one per line."""
    d = tmp_path / "bin"
    d.mkdir()
    f = d / "mpirun"
    f.write_text("#!/bin/sh\n"
                 f"if [ \"$1\" = --version ]; then echo '{version}'; exit 0; fi\n"
                 "for a in \"$@\"; do echo \"$a\"; done\n")
    f.chmod(f.stat().st_mode | stat.S_IXUSR)
    return str(d)


def argv(tmp_path, version, **env):
    e = dict(os.environ, PATH=fake_mpirun(tmp_path, version) + os.pathsep + os.environ["PATH"])
    e.pop("HVDCOMP_MPIRUN_ARGS", None)
    e.update(env)
    p = subprocess.run([RUN, "-np", "2", "echo", "hi"], env=e, capture_output=True, text=True,
                       timeout=30)
    assert p.returncode == 0, p.stderr
    return p.stdout.split("\n")


def mca(args):
    """{name: value} of the --mca pairs in ``args``."""
    return {args[i + 1]: args[i + 2] for i, a in enumerate(args) if a == "--mca"}


def test_open_mpi_takes_the_allreduce_rules(tmp_path):
    args = argv(tmp_path, "mpirun (Open MPI) 4.1.4")
    got = mca(args)
    assert got["coll_tuned_use_dynamic_rules"] == "1"
    assert got["coll_tuned_dynamic_rules_filename"] == RULES
    assert args[-3:-1] == ["echo", "hi"]


def test_user_coll_tuned_settings_replace_the_rules(tmp_path):
    args = argv(tmp_path, "mpirun (Open MPI) 4.1.4",
                HVDCOMP_MPIRUN_ARGS="--mca coll_tuned_use_dynamic_rules 0")
    assert mca(args) == {"coll_tuned_use_dynamic_rules": "0"}


def test_other_mpis_get_no_open_mpi_settings(tmp_path):
    args = argv(tmp_path, "HYDRA build details:")
    assert "--mca" not in args and "--allow-run-as-root" not in args


def test_rules_file_means_ring_from_one_mib():
    """Open MPI's dynamic rules format: collectives; then per collective its id (allreduce
    is 2 in Open MPI's coll_tuned enumeration), its communicator sizes, and per size its
    message sizes, each 'bytes algorithm fan-in/out segment-size'.  Algorithm 4 is the
    ring, 0 Open MPI's own decision (ompi_info --param coll tuned --level 9)."""
    nums = [list(map(int, line.split())) for line in open(RULES) if line.strip()]
    assert nums[:4] == [[1], [2], [1], [2]]          # 1 collective: allreduce; 1 comm size: >= 2
    assert nums[4] == [2]                            # two message-size rules
    assert nums[5] == [0, 0, 0, 0]                   # below 1 MiB: Open MPI's choice
    assert nums[6] == [1 << 20, 4, 0, 0]             # from 1 MiB: the ring
    assert len(nums) == 7


@pytest.mark.parametrize("gloo", [False, True])
def test_horovodruns_mpi_controller_gets_the_rules_too(tmp_path, gloo):
    """Under --horovodrun the rules reach Horovod's mpirun through --mpi-args (its MPI
    controller); with --gloo no mpirun runs, and none are passed."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    hr = venv / "bin" / "horovodrun"
    hr.write_text("#!/bin/sh\nfor a in \"$@\"; do echo \"$a\"; done\n")
    hr.chmod(hr.stat().st_mode | stat.S_IXUSR)
    e = dict(os.environ, HVDCOMP_VENV=str(venv),
             PATH=fake_mpirun(tmp_path, "mpirun (Open MPI) 4.1.4") + os.pathsep
             + os.environ["PATH"])
    cmd = [RUN, "--horovodrun"] + (["--gloo"] if gloo else []) + ["-np", "2", "echo", "hi"]
    p = subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    args = p.stdout.split("\n")
    mpi_args = [a for a in args if a.startswith("--mpi-args=")]
    if gloo:
        assert "--gloo" in args and not mpi_args
    else:
        assert mpi_args == [f"--mpi-args=--mca coll_tuned_use_dynamic_rules 1 --mca "
                            f"coll_tuned_dynamic_rules_filename {RULES}"]
