"""Deployment beyond systemd (deploy/): the Kubernetes manifests and the Slurm scripts.

The manifests are checked against Kubernetes' own API schemas (kubernetes-validate,
strict: an unknown field fails), and against chunkd: the ConfigMap's chunkd.toml is
loaded by chunkd's config loader with the environment the pod gets (the Secret's
values, the downward API), and the probes, mounts, memory limit and Services are
checked against what that config says. The Slurm script is run as a program, on
node lists, with stand-ins for sinfo and scontrol.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
import shutil
import stat
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate import utils as kv_utils

from chunkd.client.core import DEFAULT_CACHE_BYTES
from chunkd.client.protocol.frames import MAX_FDS
from chunkd.errors import ConfigError
from chunkd.gateway.config import Config, load_config
from chunkd.gateway.config.addresses import split_listen
from chunkd.gateway.config.schema import SECTIONS
from chunkd.gateway.metrics import Metrics
from chunkd.gateway.peers import Peers

REPO = Path(__file__).resolve().parent.parent
KUBE = REPO / "deploy" / "kubernetes"
SLURM = REPO / "deploy" / "slurm"
SCRIPT = SLURM / "chunkd_slurm.py"
DROP_IN = SLURM / "chunkd.service.d" / "slurm.conf"

#: the oldest Kubernetes the manifests are written for (internalTrafficPolicy,
#: seccompProfile and startupProbe are older); the newest schema installed is checked too
K8S_MIN = "1.30"
GiB = 1 << 30
#: the memory limit over cache.ram_bytes (daemonset.yaml says what it holds)
HEADROOM = 16 * GiB
#: the daemon's own memory, as daemonset.yaml counts it
DAEMON_OWN = 2 * GiB
#: client processes of a node the headroom is sized for: one per GPU
RANKS = 8
#: an address the downward API could give the pod
POD_IP = "10.244.3.7"


# --- the manifests, as Kubernetes reads them --------------------------------------------


def _documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def manifests() -> list[tuple[Path, dict[str, Any]]]:
    """Every Kubernetes object under deploy/kubernetes (the kustomization is not one)."""
    found = []
    for path in sorted(KUBE.rglob("*.yaml")):
        for doc in _documents(path):
            if doc["kind"] != "Kustomization":
                found.append((path, doc))
    return found


def the(kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for _, d in manifests() if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def named(items: list[dict[str, Any]], name: str) -> dict[str, Any]:
    (item,) = [i for i in items if i["name"] == name]
    return item


@pytest.fixture(scope="module")
def pod() -> dict[str, Any]:
    """The DaemonSet's pod spec."""
    spec: dict[str, Any] = the("DaemonSet", "chunkd")["spec"]["template"]["spec"]
    return spec


@pytest.fixture(scope="module")
def daemon(pod: dict[str, Any]) -> dict[str, Any]:
    return named(pod["containers"], "chunkd")


def secret_values() -> dict[str, dict[str, str]]:
    """Each Secret's data by name, as the pod reads it (stringData is plain text)."""
    return {
        doc["metadata"]["name"]: dict(doc.get("stringData", {}))
        for _, doc in manifests()
        if doc["kind"] == "Secret"
    }


_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def _expand(value: str, known: Mapping[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: earlier variables only, $$ for a dollar, an
    unknown reference left as it is."""

    def one(match: re.Match[str]) -> str:
        if match[0] == "$$":
            return "$"
        return known.get(match[1], match[0])

    return _REFERENCE.sub(one, value)


def service_links(namespace: str) -> dict[str, str]:
    """What the kubelet puts in a pod's environment for the Services of its namespace,
    when enableServiceLinks is on (the default): nothing for a headless Service."""
    env = {}
    for _, doc in manifests():
        if doc["kind"] != "Service" or doc["metadata"].get("namespace") != namespace:
            continue
        if doc["spec"].get("clusterIP") == "None":
            continue
        prefix = doc["metadata"]["name"].upper().replace("-", "_")
        first = doc["spec"]["ports"][0]
        env[f"{prefix}_SERVICE_HOST"] = "10.96.0.17"
        env[f"{prefix}_SERVICE_PORT"] = str(first["port"])
        env[f"{prefix}_PORT"] = f"tcp://10.96.0.17:{first['port']}"
        for port in doc["spec"]["ports"]:
            if "name" in port:
                env[f"{prefix}_SERVICE_PORT_{port['name'].upper().replace('-', '_')}"] = str(
                    port["port"]
                )
            tcp = f"{prefix}_PORT_{port['port']}_{port.get('protocol', 'TCP')}"
            env[tcp] = f"tcp://10.96.0.17:{port['port']}"
            env[f"{tcp}_PROTO"] = port.get("protocol", "TCP").lower()
            env[f"{tcp}_PORT"] = str(port["port"])
            env[f"{tcp}_ADDR"] = "10.96.0.17"
    return env


def pod_environment(
    pod: dict[str, Any],
    container: dict[str, Any],
    *,
    secrets: Mapping[str, Mapping[str, str]] | None = None,
    namespace: str = "chunkd",
) -> dict[str, str]:
    """The environment ``container`` starts with: service links, envFrom, then env
    in order, each $(VAR) expanded against what came before."""
    secrets = secret_values() if secrets is None else secrets
    env = service_links(namespace) if pod.get("enableServiceLinks", True) else {}
    for source in container.get("envFrom", []):
        env.update(secrets[source["secretRef"]["name"]])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = _expand(var["value"], env)
            continue
        ref = var["valueFrom"]
        if "fieldRef" in ref:
            field = ref["fieldRef"]["fieldPath"]
            assert field == "status.podIP", f"the test knows no value for {field}"
            env[var["name"]] = POD_IP
        else:
            key = ref["secretKeyRef"]
            env[var["name"]] = secrets[key["name"]][key["key"]]
    return env


def configmap_toml() -> str:
    text: str = the("ConfigMap", "chunkd-config")["data"]["chunkd.toml"]
    return text


def load_as_pod(
    tmp_path: Path,
    pod: dict[str, Any],
    daemon: dict[str, Any],
    *,
    text: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """The ConfigMap's chunkd.toml through chunkd's loader, with the pod's environment."""
    path = tmp_path / "chunkd.toml"
    path.write_text(configmap_toml() if text is None else text)
    env = pod_environment(pod, daemon) if environ is None else environ
    return load_config(path, environ=env, cwd=tmp_path)


@pytest.fixture
def config(tmp_path: Path, pod: dict[str, Any], daemon: dict[str, Any]) -> Config:
    return load_as_pod(tmp_path, pod, daemon)


def mount_of(container: dict[str, Any], path: PurePosixPath) -> dict[str, Any]:
    """The volume mount ``path`` lies under (the deepest one)."""
    under = [
        m
        for m in container["volumeMounts"]
        if path == PurePosixPath(m["mountPath"]) or PurePosixPath(m["mountPath"]) in path.parents
    ]
    assert under, f"{path} is on no volume of {container['name']}"
    deepest: dict[str, Any] = max(under, key=lambda m: len(m["mountPath"]))
    return deepest


_QUANTITY = re.compile(r"([0-9]+)(Ki|Mi|Gi|Ti|k|M|G|T)?")
_UNITS = {None: 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
_UNITS.update({"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12})


def quantity_bytes(text: str | int) -> int:
    """A Kubernetes memory quantity in bytes (whole numbers; what the manifests use)."""
    match = _QUANTITY.fullmatch(str(text))
    assert match, f"{text!r}: not a quantity this test reads"
    return int(match[1]) * _UNITS[match[2]]


def container_port(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    number: int = named(container["ports"], port)["containerPort"]
    return number


# --- the manifests against Kubernetes' schemas --------------------------------------------


@pytest.mark.parametrize("version", [K8S_MIN, kv_utils.latest_version()])
def test_every_manifest_passes_the_strict_schema(version: str) -> None:
    checked = []
    for path, doc in manifests():
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{path.relative_to(REPO)} {doc['kind']}: {exc.message} at {exc.path}")
        checked.append(doc["kind"])
    assert sorted(set(checked)) == [
        "ConfigMap",
        "DaemonSet",
        "Namespace",
        "Pod",
        "PriorityClass",
        "Secret",
        "Service",
        "ServiceAccount",
    ]


@pytest.mark.parametrize(
    ("where", "field"),
    [
        ((), "terminationGracePeriod"),  # for terminationGracePeriodSeconds
        (("containers", 0), "livenesProbe"),
        (("containers", 0, "securityContext"), "dropCapabilities"),
    ],
)
def test_a_misspelled_field_fails_the_schema(where: tuple[str | int, ...], field: str) -> None:
    daemonset = copy.deepcopy(the("DaemonSet", "chunkd"))
    node: Any = daemonset["spec"]["template"]["spec"]
    for step in where:
        node = node[step]
    node[field] = 30
    with pytest.raises(kubernetes_validate.ValidationError, match=re.escape(repr(field))):
        kubernetes_validate.validate(daemonset, K8S_MIN, strict=True)


def test_kustomization_applies_everything_but_templates_and_examples() -> None:
    (kustomization,) = _documents(KUBE / "kustomization.yaml")
    listed = set(kustomization["resources"])
    files = {p.name for p in KUBE.glob("*.yaml")} - {"kustomization.yaml"}
    # The Secret template's values are public: each cluster makes its own.
    assert listed == files - {"secret.yaml"}
    assert all((KUBE / name).is_file() for name in listed)
    image = the("DaemonSet", "chunkd")["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image.rpartition(":")[0] in {i["name"] for i in kustomization["images"]}


# --- the ConfigMap as chunkd reads it in the pod -------------------------------------------


def test_the_configmap_loads_with_the_pods_environment(
    config: Config, daemon: dict[str, Any]
) -> None:
    secrets = secret_values()
    assert config.peers.address == f"{POD_IP}:{config.server.port}"
    assert config.server.host == "0.0.0.0"
    assert config.server.token is not None
    assert config.server.token.reveal() == secrets["chunkd-env"]["CHUNKD_SERVER_TOKEN"]
    for backend in config.backends:
        prefix = f"CHUNKD_BACKENDS_{backend.name.upper()}_"
        assert backend.access_key_id == secrets["chunkd-env"][prefix + "ACCESS_KEY_ID"]
        secret = backend.secret_access_key
        assert secret is not None
        assert secret.reveal() == secrets["chunkd-env"][prefix + "SECRET_ACCESS_KEY"]
    # The registry must be a backend of this config that takes writes.
    registry = config.backend(config.datasets.backend)
    assert registry is not None
    assert registry.writable
    # The file the daemon is told to read is the ConfigMap's key, where it is mounted.
    command = daemon["command"]
    path = PurePosixPath(command[command.index("--config") + 1])
    mount = mount_of(daemon, path)
    assert mount["readOnly"] is True
    assert str(path.relative_to(mount["mountPath"])) in the("ConfigMap", "chunkd-config")["data"]


def test_without_the_pods_environment_the_config_has_no_self(
    tmp_path: Path, pod: dict[str, Any], daemon: dict[str, Any]
) -> None:
    with pytest.raises(ConfigError, match=r"\[peers\] has no self"):
        load_as_pod(tmp_path, pod, daemon, environ={})


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("ram_bytes =", "ram_byte =", r"\[cache\] has no key 'ram_byte'; did you mean 'ram_bytes'"),
        ("[peers]", "[peer]", r"unknown section \[peer\]; did you mean 'peers'"),
        ("token_file =", "tokenfile =", r"did you mean 'token_file'"),
        ('listen = "0.0.0.0:8470"', 'listen = "0.0.0.0"', r"listen = '0.0.0.0' has no port"),
    ],
)
def test_a_misspelled_key_in_the_configmap_fails_the_load(
    tmp_path: Path, pod: dict[str, Any], daemon: dict[str, Any], old: str, new: str, message: str
) -> None:
    text = configmap_toml()
    assert text.count(old) == 1
    with pytest.raises(ConfigError, match=message):
        load_as_pod(tmp_path, pod, daemon, text=text.replace(old, new))


def test_a_misspelled_secret_key_fails_the_load(
    tmp_path: Path, pod: dict[str, Any], daemon: dict[str, Any]
) -> None:
    secrets = copy.deepcopy(secret_values())
    env = secrets["chunkd-env"]
    env["CHUNKD_BACKENDS_DATA_SECRET_KEY"] = env.pop("CHUNKD_BACKENDS_DATA_SECRET_ACCESS_KEY")
    with pytest.raises(ConfigError, match="did you mean 'secret_access_key'"):
        load_as_pod(tmp_path, pod, daemon, environ=pod_environment(pod, daemon, secrets=secrets))


def test_the_peer_token_is_one_the_daemon_takes(tmp_path: Path, config: Config) -> None:
    token = tmp_path / "peer-token"
    token.write_text(secret_values()["chunkd-peer-token"]["peer-token"])
    token.chmod(0o600)  # what the init container's install -m 0600 makes
    peers = Peers(dataclasses.replace(config.peers, token_file=token), Metrics())
    assert peers.token == token.read_text()
    assert [m.address for m in peers.members] == [f"{POD_IP}:8470"]


def test_service_names_cannot_become_config_variables(
    tmp_path: Path, pod: dict[str, Any], daemon: dict[str, Any]
) -> None:
    assert pod["enableServiceLinks"] is False
    # Even with service links on, these Services' variables are not config variables.
    links_on = {**pod, "enableServiceLinks": True}
    environ = pod_environment(links_on, daemon)
    assert "CHUNKD_SERVICE_HOST" in environ  # the local Service: the model above runs
    load_as_pod(tmp_path, pod, daemon, environ=environ)
    # Why the names matter: a Service with a cluster IP called chunkd-server makes
    # variables with a section's prefix.
    prefixes = tuple(f"CHUNKD_{section.name.upper()}_" for section in SECTIONS)
    assert "CHUNKD_SERVER_" in prefixes
    assert all(name.startswith(prefixes) for name in service_links_of("chunkd-server"))
    # The loader passes over the shapes Kubernetes writes, so such a Service can't stop
    # the daemon nor change its config; a misspelled key is still refused (test_config).
    linked = load_as_pod(
        tmp_path, pod, daemon, environ={**environ, **service_links_of("chunkd-server")}
    )
    assert linked == load_as_pod(tmp_path, pod, daemon, environ=environ)


def service_links_of(name: str) -> dict[str, str]:
    prefix = name.upper().replace("-", "_")
    return {f"{prefix}_SERVICE_HOST": "10.96.0.18", f"{prefix}_PORT": "tcp://10.96.0.18:8470"}


# --- the pod against its config ------------------------------------------------------------


def test_probes_and_services_reach_the_listen_port(config: Config, daemon: dict[str, Any]) -> None:
    port = config.server.port
    probes = {kind: daemon[kind]["httpGet"] for kind in ("startupProbe", "livenessProbe")}
    probes["readinessProbe"] = daemon["readinessProbe"]["httpGet"]
    assert {kind: probe["path"] for kind, probe in probes.items()} == {
        "startupProbe": "/healthz",
        "livenessProbe": "/healthz",
        "readinessProbe": "/readyz",
    }
    for probe in probes.values():
        assert container_port(daemon, probe["port"]) == port
        assert probe.get("scheme", "HTTP") == "HTTP"  # no [peers] TLS in this config
    assert not config.peers.tls_enabled
    labels = the("DaemonSet", "chunkd")["spec"]["template"]["metadata"]["labels"]
    services = [d for _, d in manifests() if d["kind"] == "Service"]
    assert len(services) == 2
    for service in services:
        assert service["spec"]["selector"].items() <= labels.items()
        (service_port,) = service["spec"]["ports"]
        assert container_port(daemon, service_port["targetPort"]) == port
        assert service_port["port"] == port
    # [peers] dns is the headless Service, at the port the daemons listen on.
    headless = [s for s in services if s["spec"].get("clusterIP") == "None"]
    assert len(headless) == 1
    assert config.peers.dns is not None
    host, dns_port = split_listen(config.peers.dns)
    meta = headless[0]["metadata"]
    assert host.split(".")[:3] == [meta["name"], meta["namespace"], "svc"]
    assert dns_port == port
    # self, as the other daemons reach it: the address the headless Service returns.
    assert config.peers.address == f"{POD_IP}:{port}"


def test_the_memory_limit_is_ram_bytes_plus_the_headroom(
    config: Config, daemon: dict[str, Any]
) -> None:
    resources = daemon["resources"]
    limit = quantity_bytes(resources["limits"]["memory"])
    assert limit - config.cache.ram_bytes == HEADROOM
    assert quantity_bytes(resources["requests"]["memory"]) == limit
    assert "cpu" not in resources["limits"]  # a throttled event loop stalls every reader
    # What the headroom is for (daemonset.yaml), from the config and the client's own
    # bounds: raising inspect_workers, the client's cache or MAX_FDS must raise it.
    needed = (
        DAEMON_OWN
        + config.server.inspect_workers * config.server.inspect_memory
        + RANKS * DEFAULT_CACHE_BYTES
        + 2 * MAX_FDS * config.cache.chunk_bytes
    )
    assert needed <= HEADROOM


def test_the_grace_period_outlasts_shutdown_timeout(config: Config, pod: dict[str, Any]) -> None:
    # The drain, then the index flush and the cache's close.
    assert pod["terminationGracePeriodSeconds"] >= config.server.shutdown_timeout + 10
    assert config.server.shutdown_timeout == 10.0  # as configmap.yaml says


def test_never_two_daemons_on_a_node() -> None:
    strategy = the("DaemonSet", "chunkd")["spec"]["updateStrategy"]
    assert strategy["type"] == "RollingUpdate"
    # A surge pod would share the node's cache directory (locked) and socket path.
    assert strategy["rollingUpdate"]["maxSurge"] == 0


def test_every_path_the_config_names_is_on_the_right_volume(
    config: Config, pod: dict[str, Any], daemon: dict[str, Any]
) -> None:
    volumes = {v["name"]: v for v in pod["volumes"]}

    def volume_at(path: Path) -> dict[str, Any]:
        mount = mount_of(daemon, PurePosixPath(path))
        assert not mount.get("readOnly", False) or path == config.peers.token_file
        return volumes[mount["name"]]

    cache = volume_at(config.cache.dir)
    assert cache["hostPath"]["type"] == "Directory"  # never made on the root file system
    run = volume_at(config.server.socket.parent)
    assert PurePosixPath(run["hostPath"]["path"]) == PurePosixPath(config.server.socket.parent)
    assert config.peers.token_file is not None
    assert "emptyDir" in volume_at(config.peers.token_file)
    assert "emptyDir" in volume_at(Path("/tmp"))
    # The init container prepares those very volumes for the daemon's user.
    prepare = named(pod["initContainers"], "prepare")
    script = prepare["command"][-1]
    uid, gid = pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]
    assert f"chown {uid}:{gid} {config.cache.dir} {config.server.socket.parent}\n" in script
    assert f"install -o {uid} -g {gid} -m 0600 " in script
    assert script.rstrip().endswith(f" {config.peers.token_file}")
    for path in (config.cache.dir, config.server.socket.parent, config.peers.token_file.parent):
        mine, theirs = mount_of(daemon, PurePosixPath(path)), mount_of(prepare, PurePosixPath(path))
        assert (mine["name"], mine["mountPath"]) == (theirs["name"], theirs["mountPath"])
    secret_mount = named(prepare["volumeMounts"], "peer-token")
    assert volumes["peer-token"]["secret"]["secretName"] == "chunkd-peer-token"
    assert f"{secret_mount['mountPath']}/peer-token " in script


def test_a_trainer_pod_reaches_the_socket(config: Config, pod: dict[str, Any]) -> None:
    trainer_pod = the("Pod", "trainer")["spec"]
    (trainer,) = trainer_pod["containers"]
    env = pod_environment(trainer_pod, trainer, secrets={"chunkd-client": {"token": "t" * 32}})
    assert env["CHUNKD_SOCKET"] == str(config.server.socket)
    # The same host directory, read-only (connecting needs no write access).
    mount = mount_of(trainer, PurePosixPath(config.server.socket))
    assert mount["readOnly"] is True
    assert PurePosixPath(mount["mountPath"]) == PurePosixPath(config.server.socket.parent)
    volume = named(trainer_pod["volumes"], mount["name"])
    daemon_run = named(pod["volumes"], "run")
    assert volume["hostPath"]["path"] == daemon_run["hostPath"]["path"]
    # The socket's group: the daemon's own (socket_group unset), which trainers hold.
    assert config.server.socket_group is None
    assert config.server.socket_mode & 0o060 == 0o060
    assert (
        pod["securityContext"]["runAsGroup"] in trainer_pod["securityContext"]["supplementalGroups"]
    )
    assert env["CHUNKD_TOKEN"]  # for HTTP: a pod is not on the daemon's loopback


def test_the_pod_drops_what_it_can(pod: dict[str, Any], daemon: dict[str, Any]) -> None:
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert not pod.get("hostNetwork", False)
    assert daemon["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    prepare = named(pod["initContainers"], "prepare")["securityContext"]
    assert prepare["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}
    assert prepare["allowPrivilegeEscalation"] is False
    assert the("ServiceAccount", "chunkd")["automountServiceAccountToken"] is False
    assert pod["priorityClassName"] == the("PriorityClass", "chunkd-node")["metadata"]["name"]
    assert the("DaemonSet", "chunkd")["spec"]["template"]["spec"]["nodeSelector"]


# --- Slurm -----------------------------------------------------------------------------------

NODES = ["gpu001", "gpu002", "gpu003", "gpu004", "gpu007"]  # gpu[001-004,007]
EXAMPLE = REPO / "systemd" / "chunkd.toml"


def run_script(
    *args: str | Path,
    stdin: str = "",
    env: Mapping[str, str] | None = None,
    hostname: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """chunkd_slurm.py as a program, with no chunkd on its path (it needs none)."""
    argv = [sys.executable, "-I", str(SCRIPT), *map(str, args)]
    if hostname is not None:
        # A UTS namespace of its own, so the script sees this host name.
        argv = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', hostname, *argv]
    base = {"PATH": os.environ["PATH"]}
    return subprocess.run(
        argv,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**base, **(env or {})},
    )


def members_of(path: Path) -> list[str]:
    return [
        line for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")
    ]


@pytest.fixture
def token(tmp_path: Path) -> Path:
    path = tmp_path / "peer-token"
    path.write_text("s" * 32)
    path.chmod(0o600)
    return path


def test_a_node_list_becomes_a_members_file_chunkd_takes(tmp_path: Path, token: Path) -> None:
    members = tmp_path / "members"
    listen = {"CHUNKD_SERVER_LISTEN": "0.0.0.0:8470"}
    stdin = "\n".join(NODES) + "\n"  # what `scontrol show hostnames gpu[001-004,007]` prints
    done = run_script(
        "members", "-", "--config", EXAMPLE, "--output", members, stdin=stdin, env=listen
    )
    assert done.returncode == 0, done.stderr
    assert members_of(members) == [f"{node}:8470" for node in NODES]
    assert stat.S_IMODE(members.stat().st_mode) == 0o644
    done = run_script(
        "self", "--config", EXAMPLE, "--members", members, "--node-name", "gpu003", env=listen
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "CHUNKD_PEERS_SELF=gpu003:8470\n"
    environ = {
        **listen,
        **dict([done.stdout.strip().split("=", 1)]),
        "CHUNKD_PEERS_MEMBERS_FILE": str(members),
        "CHUNKD_PEERS_TOKEN_FILE": str(token),
    }
    config = load_config(EXAMPLE, environ=environ)
    assert config.peers.members_file == members
    assert config.peers.address == "gpu003:8470"
    # The daemon's own view: five members, itself once among them.
    peers = Peers(config.peers, Metrics())
    assert [m.address for m in peers.members] == [f"{node}:8470" for node in NODES]
    assert peers.is_self("gpu003:8470")
    for entry in members_of(members):
        split_listen(entry)  # each line is a host:port chunkd's own parser takes


@pytest.mark.parametrize(
    ("toml", "environ"),
    [
        ('[server]\nlisten = "0.0.0.0:9470"\n', {}),
        ('[server]\nlisten = "gpu003.cluster:9471"\n', {}),
        ('[server]\nlisten = "127.0.0.1:8470"\n', {"CHUNKD_SERVER_LISTEN": "[::]:9472"}),
        ("", {"CHUNKD_SERVER_LISTEN": "0.0.0.0:9473"}),
    ],
    ids=["file", "host-name", "environment-wins", "default-file"],
)
def test_the_port_is_the_one_chunkd_listens_on(
    tmp_path: Path, toml: str, environ: dict[str, str]
) -> None:
    path = tmp_path / "chunkd.toml"
    path.write_text(toml + '[[backends]]\nname = "data"\nurl = "memory://"\n')
    expected = load_config(path, environ=environ).server.port
    done = run_script("members", "-", "--config", path, stdin="gpu001\n", env=environ)
    assert done.returncode == 0, done.stderr
    assert members_of_text(done.stdout) == [f"gpu001:{expected}"]


def members_of_text(text: str) -> list[str]:
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def test_a_loopback_listener_is_refused() -> None:
    # systemd/chunkd.toml as shipped listens on 127.0.0.1: no peer could reach it.
    done = run_script("members", "-", "--config", EXAMPLE, stdin="gpu001\n")
    assert done.returncode == 1
    assert "'127.0.0.1:8470', which other nodes cannot reach" in done.stderr
    assert done.stdout == ""


def test_addresses_and_bad_names(tmp_path: Path) -> None:
    listen = {"CHUNKD_SERVER_LISTEN": "0.0.0.0:8470"}
    nodes = tmp_path / "nodes"
    nodes.write_text("# NodeAddr of each node\n10.1.0.1\nfd00::2  gpu003\n10.1.0.1\n")
    done = run_script("members", nodes, env=listen)
    assert done.returncode == 0, done.stderr
    assert members_of_text(done.stdout) == ["10.1.0.1:8470", "[fd00::2]:8470", "gpu003:8470"]
    for entry in members_of_text(done.stdout):
        split_listen(entry)  # chunkd's own host:port parser takes each line
    done = run_script("members", nodes, "--output", tmp_path / "absent" / "members", env=listen)
    assert done.returncode == 1
    assert f"cannot write {tmp_path / 'absent' / 'members'}: No such file" in done.stderr
    nodes.write_text("gpu001\ngpu002;reboot\n")
    done = run_script("members", nodes, env=listen)
    assert done.returncode == 1
    assert "line 2: 'gpu002;reboot' is not a host name" in done.stderr


def test_self_must_be_spelled_as_the_members_file_spells_it(tmp_path: Path) -> None:
    listen = {"CHUNKD_SERVER_LISTEN": "0.0.0.0:8470"}
    members = tmp_path / "members"
    members.write_text("gpu001.cluster:8470\ngpu003.cluster:8470\n")
    done = run_script("self", "--members", members, "--node-name", "gpu003", env=listen)
    assert done.returncode == 1
    assert "'gpu003:8470' is not in the members file" in done.stderr
    assert "give --node-name gpu003.cluster" in done.stderr
    done = run_script("self", "--members", members, "--node-name", "gpu003.cluster", env=listen)
    assert done.returncode == 0, done.stderr
    # No members file yet (slurmctld was down at start): self is written unchecked.
    done = run_script("self", "--members", tmp_path / "absent", "--node-name", "gpu009", env=listen)
    assert (done.returncode, done.stdout) == (0, "CHUNKD_PEERS_SELF=gpu009:8470\n")


@pytest.fixture
def fake_slurm(tmp_path: Path) -> Path:
    """sinfo and scontrol stand-ins that answer only the exact commands the script and
    the drop-in should run, and log each call."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "slurm.log"
    names = "\\n".join(NODES)
    (bin_dir / "sinfo").write_text(
        "#!/bin/sh\n"
        f'echo "sinfo $*" >> {log}\n'
        'if [ "$*" = "--noheader --Node --partition gpu --format %N" ]; then\n'
        f'  printf "{names}\\n"; exit 0\n'
        "fi\n"
        'echo "sinfo: unexpected arguments: $*" >&2; exit 1\n'
    )
    (bin_dir / "scontrol").write_text(
        "#!/bin/sh\n"
        f'echo "scontrol $*" >> {log}\n'
        'if [ "$*" = "show hostnames gpu[001-004,007]" ]; then\n'
        f'  printf "{names}\\n"; exit 0\n'
        "fi\n"
        'echo "scontrol: unexpected arguments: $*" >&2; exit 1\n'
    )
    for tool in ("sinfo", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    return bin_dir


def test_partition_and_nodelist_go_through_slurm(tmp_path: Path, fake_slurm: Path) -> None:
    env = {"CHUNKD_SERVER_LISTEN": "0.0.0.0:8470", "PATH": f"{fake_slurm}:{os.environ['PATH']}"}
    for source in (("--partition", "gpu"), ("--nodelist", "gpu[001-004,007]")):
        done = run_script("members", *source, env=env)
        assert done.returncode == 0, done.stderr
        assert members_of_text(done.stdout) == [f"{node}:8470" for node in NODES]
    # A failing Slurm command leaves the members file as it was.
    members = tmp_path / "members"
    members.write_text("gpu001:8470\n")
    done = run_script("members", "--partition", "cpu", "--output", members, env=env)
    assert done.returncode == 1
    assert "sinfo: unexpected arguments" in done.stderr
    assert members.read_text() == "gpu001:8470\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["bin", "members", "slurm.log"]
    )  # no temporary file left behind
    done = run_script("members", "--partition", "gpu", env={"CHUNKD_SERVER_LISTEN": "0.0.0.0:1"})
    assert done.returncode == 1
    assert "sinfo is not on PATH" in done.stderr


def drop_in() -> tuple[list[str], dict[str, str], list[str]]:
    """The drop-in's ExecStartPre= commands, Environment= and EnvironmentFile=."""
    commands, environment, files = [], {}, []
    for raw in DROP_IN.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        if key == "ExecStartPre":
            commands.append(value)
        elif key == "Environment":
            name, _, val = value.partition("=")
            environment[name] = val
        elif key == "EnvironmentFile":
            files.append(value)
    return commands, environment, files


def test_the_drop_in_runs_as_written(tmp_path: Path, fake_slurm: Path, token: Path) -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) to give the script a host name of its own")
    probe = subprocess.run(["unshare", "--uts", "true"], capture_output=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"unshare --uts is refused here: {probe.stderr.decode().strip()}")
    commands, environment, files = drop_in()
    assert len(commands) == 2
    run = tmp_path / "run"
    run.mkdir()

    def here(text: str) -> str:
        # The installed paths, as in the drop-in's install lines, onto this checkout.
        return (
            text.replace("/opt/chunkd/bin/python", sys.executable)
            .replace("/usr/lib/chunkd/chunkd_slurm.py", str(SCRIPT))
            .replace("/etc/chunkd/chunkd.toml", str(EXAMPLE))
            .replace("/etc/chunkd/peer-token", str(token))
            .replace("/run/chunkd/", f"{run}/")
        )

    env = {name: here(value) for name, value in environment.items()}
    env["PATH"] = f"{fake_slurm}:{os.environ['PATH']}"
    for command in commands:
        # "-" (failure tolerated) or not, both succeed with Slurm answering.
        argv = here(command.lstrip("-")).split()
        assert argv[:2] == [sys.executable, str(SCRIPT)], command
        done = run_script(*argv[2:], env=env, hostname="gpu003.cluster.example")
        assert done.returncode == 0, (command, done.stderr)
    assert (
        tmp_path / "slurm.log"
    ).read_text() == "sinfo --noheader --Node --partition gpu --format %N\n"
    (self_env,) = [here(f.lstrip("-")) for f in files]
    assert Path(self_env).read_text() == "CHUNKD_PEERS_SELF=gpu003:8470\n"
    # What ExecStart= then starts with: the unit's example config, unchanged.
    name, _, value = Path(self_env).read_text().strip().partition("=")
    config = load_config(EXAMPLE, environ={**env, name: value})
    assert config.peers.members_file == run / "members"
    assert config.server.port == 8470
    peers = Peers(config.peers, Metrics())
    assert [m.address for m in peers.members] == [f"{node}:8470" for node in NODES]


# --- the page --------------------------------------------------------------------------------


def test_the_deploy_page_names_every_file() -> None:
    page = (REPO / "docs" / "deploy.md").read_text()
    for path in sorted(p for p in (REPO / "deploy").rglob("*") if p.is_file()):
        if "__pycache__" in path.parts:
            continue
        assert str(path.relative_to(REPO)) in page, path
