"""launch/setup refuses a venv that belongs to another checkout (newcomer trial, item 1).

A clone whose ``.venv`` was a symbolic link to another checkout's venv ran launch/setup,
whose editable install then re-pointed that venv's ``import hvdcomp`` at the clone.
launch/check-venv, which setup runs before it changes anything, refuses then.  The venvs
here are real ones (``venv.create``, no pip) in a temporary directory, with the
``direct_url.json`` pip writes for an editable install (PEP 610); no shared venv is
touched."""
import hashlib
import json
import os
import shutil
import subprocess
import venv

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHECK = os.path.join(ROOT, "launch", "check-venv")


def _venv(path, installed_from=None, editable=True):
    """A venv at ``path``; with ``installed_from``, hvdcomp's metadata as pip leaves it
    after ``pip install [-e] installed_from``."""
    venv.create(path, with_pip=False, symlinks=True)
    if installed_from is not None:
        site = subprocess.run(
            [os.path.join(path, "bin", "python"), "-I", "-c",
             "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True, capture_output=True, text=True).stdout.strip()
        info = os.path.join(site, "hvdcomp-0.1.0.dist-info")
        os.makedirs(info)
        with open(os.path.join(info, "METADATA"), "w") as f:
            f.write("Metadata-Version: 2.1\nName: hvdcomp\nVersion: 0.1.0\n")
        with open(os.path.join(info, "direct_url.json"), "w") as f:
            json.dump({"dir_info": {"editable": editable},
                       "url": "file://" + os.path.realpath(installed_from)}, f)
    return path


def _check(checkout, venv_path):
    return subprocess.run([CHECK, checkout, venv_path], capture_output=True, text=True,
                          timeout=120)


@pytest.fixture
def two_checkouts(tmp_path):
    """``main`` and ``clone``: two directories standing for two checkouts (each with the
    hvdcomp/ package directory a checkout has)."""
    main, clone = tmp_path / "main", tmp_path / "clone"
    (main / "hvdcomp").mkdir(parents=True)
    (clone / "hvdcomp").mkdir(parents=True)
    return str(main), str(clone)


def _other_owner_message(venv_path, owner, checkout):
    return ("hvdcomp setup: ERROR: the virtual environment %s holds an editable install of "
            "hvdcomp from %s; setting up here would re-install it from %s, so that every "
            "user of that venv would import this checkout's hvdcomp instead. Nothing was "
            "changed." % (venv_path, owner, checkout))


def test_a_link_to_another_checkouts_venv_is_refused(two_checkouts):
    main, clone = two_checkouts
    _venv(os.path.join(main, ".venv"), installed_from=main)
    os.symlink(os.path.join(main, ".venv"), os.path.join(clone, ".venv"))
    r = _check(clone, os.path.join(clone, ".venv"))
    assert r.returncode == 1
    assert r.stderr.startswith(_other_owner_message(os.path.join(clone, ".venv"), main, clone))
    assert "run launch/setup in %s, the checkout the venv belongs to" % main in r.stderr
    assert ("Either make a venv of your own (remove the link %s, or set HVDCOMP_VENV=<a new "
            "directory>, then run launch/setup again)" % os.path.join(clone, ".venv")
            in r.stderr)


def test_a_venv_named_by_HVDCOMP_VENV_holding_another_checkout_is_refused(two_checkouts):
    main, clone = two_checkouts
    other = _venv(os.path.join(main, ".venv"), installed_from=main)
    r = _check(clone, other)
    assert r.returncode == 1
    assert r.stderr.startswith(_other_owner_message(other, main, clone))
    # a real directory (e.g. a shared venv) is someone else's: no advice to remove it
    assert ("Either make a venv of your own (set HVDCOMP_VENV=<a new directory>, then run "
            "launch/setup again), or run launch/setup in %s, the checkout the venv belongs "
            "to" % main in r.stderr)
    assert "remove" not in r.stderr


def test_a_clones_own_venv_directory_holding_another_checkout_is_not_offered_for_removal(
        two_checkouts):
    """The default <checkout>/.venv, a real directory (not a link) holding another
    checkout's editable install: refused, and nothing suggests deleting it."""
    main, clone = two_checkouts
    path = _venv(os.path.join(clone, ".venv"), installed_from=main)
    r = _check(clone, path)
    assert r.returncode == 1
    assert r.stderr.startswith(_other_owner_message(path, main, clone))
    assert "(set HVDCOMP_VENV=<a new directory>, then run launch/setup again)" in r.stderr
    assert "remove" not in r.stderr


def _stale_note(venv_path, old, checkout):
    return ("hvdcomp setup: note: %s holds a stale editable install of hvdcomp from %s (no "
            "longer a checkout: moved or removed); it will be re-pointed at %s\n"
            % (venv_path, old, checkout))


@pytest.mark.parametrize("old_state", ["gone", "no hvdcomp/ package directory"])
def test_a_moved_checkouts_own_venv_passes_with_a_note(tmp_path, old_state):
    """A checkout moved or renamed: its venv's direct_url.json still names the old path.
    That install is nobody's (the old path is no checkout): setup may go on and re-point
    it, saying so in one line."""
    old = tmp_path / "old-name"
    if old_state == "no hvdcomp/ package directory":
        old.mkdir()                           # e.g. a new, unrelated directory there
    moved = tmp_path / "new-name"
    (moved / "hvdcomp").mkdir(parents=True)
    path = _venv(str(moved / ".venv"), installed_from=str(old))
    r = _check(str(moved), path)
    assert (r.returncode, r.stderr) == (0, _stale_note(path, str(old), str(moved)))


def test_a_link_to_a_venv_with_a_stale_install_is_still_refused(tmp_path):
    """Stale is no proof the venv is this checkout's: a link to it is refused as a link
    (the link's own message)."""
    target = _venv(str(tmp_path / "elsewhere" / "venv"), installed_from=str(tmp_path / "gone"))
    checkout = tmp_path / "checkout"
    (checkout / "hvdcomp").mkdir(parents=True)
    link = str(checkout / ".venv")
    os.symlink(target, link)
    r = _check(str(checkout), link)
    assert r.returncode == 1
    assert r.stderr.startswith(
        "hvdcomp setup: ERROR: %s is a symbolic link to %s, which may be another checkout's "
        "virtual environment" % (link, os.path.realpath(target)))


def test_a_link_to_a_venv_without_hvdcomp_is_refused(two_checkouts):
    main, clone = two_checkouts
    target = _venv(os.path.join(main, ".venv"))
    link = os.path.join(clone, ".venv")
    os.symlink(target, link)
    r = _check(clone, link)
    assert r.returncode == 1
    assert r.stderr.startswith(
        "hvdcomp setup: ERROR: %s is a symbolic link to %s, which may be another checkout's "
        "virtual environment" % (link, os.path.realpath(target)))
    assert r.stderr.rstrip().endswith("HVDCOMP_VENV=%s launch/setup" % os.path.realpath(target))


@pytest.mark.parametrize("case", ["own venv, installed", "own venv, no hvdcomp",
                                  "own venv, non-editable install", "no venv yet",
                                  "link to a venv installed from this checkout"])
def test_a_venv_of_this_checkout_passes(two_checkouts, case):
    main, clone = two_checkouts
    path = os.path.join(clone, ".venv")
    if case == "own venv, installed":
        _venv(path, installed_from=clone)
    elif case == "own venv, no hvdcomp":
        _venv(path)
    elif case == "own venv, non-editable install":   # setup replaces it: nobody else's
        _venv(path, installed_from=main, editable=False)
    elif case == "link to a venv installed from this checkout":   # e.g. on a faster disk
        os.symlink(_venv(os.path.join(main, "venv-for-clone"), installed_from=clone), path)
    r = _check(clone, path)
    assert (r.returncode, r.stderr) == (0, "")


def test_setup_refuses_before_it_changes_anything(two_checkouts, tmp_path):
    """launch/setup itself (a copy, in the clone) stops at the check: status 1, the
    message, and the other checkout's venv exactly as it was."""
    main, clone = two_checkouts
    _venv(os.path.join(main, ".venv"), installed_from=main)
    os.symlink(os.path.join(main, ".venv"), os.path.join(clone, ".venv"))
    os.makedirs(os.path.join(clone, "launch"))
    for name in ("launch/setup", "launch/check-venv", "pyproject.toml", "setup.cfg"):
        shutil.copy2(os.path.join(ROOT, name), os.path.join(clone, name))

    def tree():
        out = []
        for d, _, files in os.walk(os.path.join(main, ".venv")):
            for f in files:
                p = os.path.join(d, f)
                out.append((p, os.path.getmtime(p), os.path.getsize(p)))
        return sorted(out)

    before = tree()
    env = {k: v for k, v in os.environ.items() if k not in ("HVDCOMP_VENV", "HVDCOMP_PYTHON")}
    env["HVDCOMP_CACHE"] = str(tmp_path / "cache")
    r = subprocess.run([os.path.join(clone, "launch", "setup")], capture_output=True,
                       text=True, timeout=120, env=env)
    assert r.returncode == 1
    assert r.stderr.startswith(_other_owner_message(os.path.join(clone, ".venv"), main, clone))
    assert tree() == before
    assert not os.path.exists(tmp_path / "cache")


def _set_up_venv(path, checkout, installed_from=None):
    """A venv at ``path`` as launch/setup leaves it for ``checkout``, as far as setup's
    "already set up" check looks: hvdcomp's editable-install metadata, importable
    horovod.torch, mpi4py.MPI, torch and hvdcomp (empty modules), and the stamp named by
    the digest of the checkout's launch/setup, pyproject.toml and setup.cfg.
    ``installed_from``: the editable install's directory, when not ``checkout``."""
    _venv(path, installed_from=installed_from or checkout)
    site = subprocess.run([os.path.join(path, "bin", "python"), "-I", "-c",
                           "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    modules = ["horovod/__init__.py", "horovod/torch.py", "mpi4py/__init__.py",
               "mpi4py/MPI.py", "torch.py"]
    if installed_from is None:          # a stale editable install imports nothing
        modules.append("hvdcomp/__init__.py")
    for module in modules:
        os.makedirs(os.path.dirname(os.path.join(site, module)), exist_ok=True)
        open(os.path.join(site, module), "w").close()
    digest = hashlib.sha256()
    for name in ("launch/setup", "pyproject.toml", "setup.cfg"):
        with open(os.path.join(checkout, name), "rb") as f:
            digest.update(f.read())
    open(os.path.join(path, ".hvdcomp-setup-" + digest.hexdigest()[:16]), "w").close()


def _tool_path(tmp_path):
    """A PATH with only the tools setup's first lines use and a do-nothing mpirun: no mpicc,
    apt-get or pip, so that a setup past its "already set up" check stops at once (MPI
    not found) instead of installing anything."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "cat", "sha256sum", "cut", "dirname", "readlink", "id"):
        os.symlink(shutil.which(tool), bin_dir / tool)
    (bin_dir / "mpirun").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "mpirun").chmod(0o755)
    return str(bin_dir)


def test_setup_checks_the_venv_before_its_already_set_up_exit(two_checkouts, tmp_path):
    """Review finding: setup's "already set up" exit came before the check, so a clone at
    the same commit whose .venv links another checkout's set-up venv exited 0, silently.
    The same venv and stamp let the owner's setup exit 0 at once (so the stamp is one
    setup's fast path takes); the clone's setup is refused."""
    main, clone = two_checkouts
    for checkout in (main, clone):
        os.makedirs(os.path.join(checkout, "launch"))
        for name in ("launch/setup", "launch/check-venv", "pyproject.toml", "setup.cfg"):
            shutil.copy2(os.path.join(ROOT, name), os.path.join(checkout, name))
    _set_up_venv(os.path.join(main, ".venv"), main)
    os.symlink(os.path.join(main, ".venv"), os.path.join(clone, ".venv"))
    env = {"PATH": _tool_path(tmp_path), "HOME": str(tmp_path),
           "HVDCOMP_CACHE": str(tmp_path / "cache")}

    r = subprocess.run([os.path.join(main, "launch", "setup")], capture_output=True,
                       text=True, timeout=120, env=env, cwd=str(tmp_path))
    assert (r.returncode, r.stderr) == (0, "")      # the owner: already set up

    r = subprocess.run([os.path.join(clone, "launch", "setup")], capture_output=True,
                       text=True, timeout=120, env=env, cwd=str(tmp_path))
    assert r.returncode == 1
    assert r.stderr.startswith(_other_owner_message(os.path.join(clone, ".venv"), main, clone))
    assert not os.path.exists(tmp_path / "cache")


def test_a_moved_checkouts_setup_re_points_the_stale_install(tmp_path):
    """A moved checkout, set up before it moved (stamp present), run from its own
    directory: the "already set up" check imports what the venv has installed (not the
    hvdcomp/ in the current directory), so setup goes on to re-point the stale install;
    here it stops at once after the note (no MPI on this PATH) instead of exiting 0."""
    moved = tmp_path / "new-name"
    (moved / "hvdcomp").mkdir(parents=True)
    os.makedirs(moved / "launch")
    for name in ("launch/setup", "launch/check-venv", "pyproject.toml", "setup.cfg"):
        shutil.copy2(os.path.join(ROOT, name), moved / name)
    path = str(moved / ".venv")
    _set_up_venv(path, str(moved), installed_from=str(tmp_path / "old-name"))
    env = {"PATH": _tool_path(tmp_path), "HOME": str(tmp_path),
           "HVDCOMP_CACHE": str(tmp_path / "cache")}
    r = subprocess.run([str(moved / "launch" / "setup")], capture_output=True, text=True,
                       timeout=120, env=env, cwd=str(moved))
    note = _stale_note(path, str(tmp_path / "old-name"), str(moved))
    assert r.returncode == 1
    assert r.stderr.startswith(note + "hvdcomp setup: ERROR: MPI not found"), r.stderr
