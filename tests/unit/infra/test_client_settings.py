"""The client settings file (``.renderfarm/env``, written by ``renderfarm up``): found in the
working directory or a parent, below the environment in precedence, switched off by an empty
``RENDERFARM_ENV_FILE`` (as the test suite's conftest does), and its S3 keys handed to boto3 only
when the environment has none."""

from __future__ import annotations

import pytest

from infra.settings import DEFAULT_ENV_FILE, ENV_FILE_VAR, Settings, env_file_path

FILE = ("# written by `renderfarm up`\n"
        "RENDERFARM_API_URL=http://127.0.0.1:8123\n"
        "RENDERFARM_S3_BUCKET=from-the-file\n"
        "AWS_ACCESS_KEY_ID=file-key\n"
        "AWS_SECRET_ACCESS_KEY=file-secret\n")


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A directory holding a client settings file, and the environment of a fresh shell."""
    (tmp_path / DEFAULT_ENV_FILE).parent.mkdir()
    (tmp_path / DEFAULT_ENV_FILE).write_text(FILE)
    for name in ("RENDERFARM_API_URL", "RENDERFARM_S3_BUCKET", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv(ENV_FILE_VAR, raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_suite_reads_no_client_settings_file():
    # tests/conftest.py switches the file off before anything reads a setting
    import os

    assert os.environ[ENV_FILE_VAR] == "" and env_file_path() is None


def test_found_here_and_in_parent_directories(project, monkeypatch):
    assert env_file_path() == project / DEFAULT_ENV_FILE
    deeper = project / "a" / "b"
    deeper.mkdir(parents=True)
    monkeypatch.chdir(deeper)
    assert env_file_path() == project / DEFAULT_ENV_FILE
    settings = Settings()
    assert (settings.api_url, settings.s3_bucket) == ("http://127.0.0.1:8123", "from-the-file")
    assert env_file_path(for_writing=True) == deeper / DEFAULT_ENV_FILE


def test_the_environment_wins_over_the_file(project, monkeypatch):
    monkeypatch.setenv("RENDERFARM_S3_BUCKET", "from-the-environment")
    settings = Settings()
    assert settings.s3_bucket == "from-the-environment" and settings.api_url == "http://127.0.0.1:8123"
    assert Settings(s3_bucket="from-an-argument").s3_bucket == "from-an-argument"


def test_an_empty_or_other_env_file_variable(project, monkeypatch, tmp_path_factory):
    monkeypatch.setenv(ENV_FILE_VAR, "")
    assert env_file_path() is None and env_file_path(for_writing=True) is None
    assert Settings().api_url == "http://127.0.0.1:8000"
    other = tmp_path_factory.mktemp("elsewhere") / "farm.env"
    other.write_text("RENDERFARM_API_URL=http://10.0.0.7:8000\n")
    monkeypatch.setenv(ENV_FILE_VAR, str(other))
    assert env_file_path() == other and Settings().api_url == "http://10.0.0.7:8000"


def test_no_file_means_the_defaults(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_FILE_VAR, raising=False)
    monkeypatch.delenv("RENDERFARM_API_URL", raising=False)
    monkeypatch.chdir(tmp_path)
    assert env_file_path() is None or not str(env_file_path()).startswith(str(tmp_path))
    assert env_file_path(for_writing=True) == tmp_path / DEFAULT_ENV_FILE


def test_s3_keys_of_the_file_reach_boto3_only_without_keys_in_the_environment(project, monkeypatch):
    settings = Settings()
    assert settings.s3_credentials() == {"aws_access_key_id": "file-key", "aws_secret_access_key": "file-secret"}
    assert "file-secret" not in repr(settings), "the secret is not printed with the settings"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "env-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "env-secret")
    assert Settings().s3_credentials() == {}, "boto3's own chain (environment, session token, roles) applies"
    monkeypatch.setenv(ENV_FILE_VAR, "")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    assert Settings().s3_credentials() == {}


def test_a_local_stack_never_reads_a_client_settings_file(project, tmp_path_factory):
    from infra.localstack import LocalStack

    stack = LocalStack(workers=1, run_dir=tmp_path_factory.mktemp("run"))  # builds nothing, starts nothing
    assert stack.bucket == "renders", "not the file's bucket: that file may be another stack's"
    assert stack.api.env["RENDERFARM_ENV_FILE"] == "" and stack.workers[0].env["RENDERFARM_ENV_FILE"] == ""
