"""deploy/kubernetes, checked without a cluster, kustomize or kubectl.

The base and the cpu overlay are rendered here as ``kubectl apply -k`` would render them (the
kustomization features they use: ``resources``, ``images`` and JSON 6902 ``patches``; any other
field fails the render, so the renderer cannot silently fall behind the manifests). Then:

* every document validates, strictly (unknown fields fail), against the Kubernetes schemas that
  ``kubernetes-validate`` bundles;
* every container's command parses with the real ``tandem`` CLI parser and its ``TANDEM_*``
  environment (``env`` and ConfigMaps) holds only names the settings of that service read, with
  values they accept;
* the addresses the draft and the gateway are pointed at name the headless Services of the
  target and the draft, on the ports those containers listen on;
* probes use the gRPC health service on each service's gRPC port (the gateway's liveness excepted);
* the base target asks for a GPU and the CUDA device, the overlay for neither.
"""

from __future__ import annotations

import copy
import functools
import os
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tandem import cli, config
from tandem.models import specs

REPO = Path(__file__).resolve().parent.parent
KUBE = REPO / "deploy" / "kubernetes"
BASE = KUBE / "base"
CPU = KUBE / "overlays" / "cpu"
CPU_TLS = KUBE / "overlays" / "cpu-tls"
TLS_MOUNT = "/etc/tandem/tls"
SERVICES = {"target": config.TargetSettings, "draft": config.DraftSettings, "gateway": config.GatewaySettings}
# The oldest Kubernetes the manifests promise to work with (the native gRPC probe is GA since
# 1.27; PDB unhealthyPodEvictionPolicy exists since 1.26), and the newest the package bundles.
K8S_VERSIONS = ("1.30", kubernetes_validate.latest_version())
# TANDEM_* variables read by the code itself rather than by a settings class: name -> the module
# that reads it (checked below, so that the list cannot outlive the code).
PROCESS_ENV = {"TANDEM_CACHE_DIR": specs}
GPU = "nvidia.com/gpu"


# -- rendering ------------------------------------------------------------------------------------


def _unescape(token: str) -> str:
    return token.replace("~1", "/").replace("~0", "~")


def _json_patch(doc: dict, ops: list[dict]) -> None:
    """RFC 6902 add / remove / replace, in place; a path that does not exist fails, as in kustomize."""
    for op in ops:
        *parents, last = [_unescape(t) for t in op["path"].split("/")[1:]]
        node = doc
        for token in parents:
            node = node[int(token)] if isinstance(node, list) else node[token]
        kind = op["op"]
        if isinstance(node, list):
            if kind == "add":
                node.insert(len(node) if last == "-" else int(last), copy.deepcopy(op["value"]))
                continue
            index = int(last)
            assert 0 <= index < len(node), f"{op['path']}: no such element"
        else:
            index = last
            assert kind == "add" or index in node, f"{op['path']}: no such member"
        if kind == "remove":
            del node[index]
        elif kind in ("add", "replace"):
            node[index] = copy.deepcopy(op["value"])
        else:
            raise AssertionError(f"the test's renderer does not apply op {kind!r}")


def _group_version(doc: dict) -> tuple[str, str]:
    group, _, version = doc["apiVersion"].rpartition("/")
    return group, version


def _selected(doc: dict, target: dict) -> bool:
    assert set(target) <= {"group", "version", "kind", "name"}, f"unsupported patch target {target}"
    group, version = _group_version(doc)
    wanted = {"group": group, "version": version, "kind": doc["kind"], "name": doc["metadata"]["name"]}
    return all(wanted[key] == value for key, value in target.items())


def _pod_specs(doc: dict) -> list[dict]:
    return [doc["spec"]["template"]["spec"]] if doc["kind"] == "Deployment" else []


def _set_image(doc: dict, image: dict) -> None:
    for pod in _pod_specs(doc):
        for container in pod.get("containers", []) + pod.get("initContainers", []):
            name, tag = _split_image(container["image"])
            if name == image["name"]:
                container["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}"


def _split_image(image: str) -> tuple[str, str]:
    name, sep, tag = image.rpartition(":")
    return (name, tag) if sep and "/" not in tag else (image, "latest")


def render(directory: Path) -> list[dict]:
    """The documents ``kubectl kustomize directory`` prints, for the features the manifests use."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unsupported = set(kustomization) - {"apiVersion", "kind", "resources", "images", "patches", "components"}
    assert not unsupported, f"{directory}: the test's renderer does not apply {sorted(unsupported)}"
    docs: list[dict] = []
    for resource in kustomization.get("resources", []):
        path = (directory / resource).resolve()
        docs += render(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    for component in kustomization.get("components", []):  # a Component patches what came before it
        _apply(directory / component, docs)
    _apply(directory, docs, kustomization)
    keys = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(keys) == len(set(keys)), f"{directory}: duplicate resources {keys}"
    return docs


def _apply(directory: Path, docs: list[dict], kustomization: dict | None = None) -> None:
    """The images and patches of ``directory``'s kustomization (a Component's: resources none)."""
    if kustomization is None:
        kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
        assert kustomization["kind"] == "Component" and not kustomization.get("resources"), directory
    for image in kustomization.get("images", []):
        for doc in docs:
            _set_image(doc, image)
    for patch in kustomization.get("patches", []):
        ops = yaml.safe_load(patch["patch"] if "patch" in patch else (directory / patch["path"]).read_text())
        assert isinstance(ops, list), "only JSON 6902 patches (a list of operations) are rendered here"
        selected = [doc for doc in docs if _selected(doc, patch["target"])]
        assert len(selected) == 1, f"patch target {patch['target']} selects {len(selected)} documents"
        _json_patch(selected[0], ops)


KUSTOMIZATIONS = {"base": BASE, "cpu": CPU, "cpu-tls": CPU_TLS}


@functools.cache
def _rendered(name: str) -> tuple[dict, ...]:
    return tuple(render(KUSTOMIZATIONS[name]))


def rendered(name: str) -> list[dict]:
    """A fresh copy of the rendered base or overlay (rendered once; a render error fails the test)."""
    return copy.deepcopy(list(_rendered(name)))


@pytest.fixture(params=sorted(KUSTOMIZATIONS))
def docs(request) -> list[dict]:
    return rendered(request.param)


def find(docs: list[dict], kind: str, name: str) -> dict:
    matches = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} found"
    return matches[0]


def deployment_of(docs: list[dict], service: str) -> dict:
    return find(docs, "Deployment", f"tandem-{service}")


def container_of(docs: list[dict], service: str) -> dict:
    containers = _pod_specs(deployment_of(docs, service))[0]["containers"]
    assert [c["name"] for c in containers] == [service]
    return containers[0]


def container_env(docs: list[dict], container: dict) -> dict[str, str]:
    """The environment the container starts with: its ConfigMaps, then ``env`` (which wins)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        assert set(source) == {"configMapRef"}, f"unexpected env source {source}"
        env.update(find(docs, "ConfigMap", source["configMapRef"]["name"])["data"])
    for var in container.get("env", []):
        assert "value" in var, f"{var['name']}: only literal values are checked here"
        env[var["name"]] = var["value"]
    return env


def settings_of(docs: list[dict], service: str, monkeypatch: pytest.MonkeyPatch):
    """The settings ``tandem <service>`` builds in that container (tandem.cli.main's own path)."""
    container = container_of(docs, service)
    args = cli.build_parser().parse_args(container["command"][1:] + container.get("args", []))
    for name in list(os.environ):
        if name.startswith("TANDEM_") or name in ("TARGET_MODEL", "DRAFT_MODEL"):
            monkeypatch.delenv(name)
    for name, value in container_env(docs, container).items():
        monkeypatch.setenv(name, value)
    return cli.settings_from(args, args.settings_cls)


def container_port(container: dict, name: str) -> int:
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    return ports[name]


# -- the tests -----------------------------------------------------------------------------------


def test_every_manifest_file_is_a_resource_of_its_kustomization() -> None:
    for directory in (BASE, CPU):
        listed = {(directory / r).resolve() for r in yaml.safe_load((directory / "kustomization.yaml").read_text())
                  ["resources"]}
        files = {p.resolve() for p in directory.glob("*.yaml")} - {(directory / "kustomization.yaml").resolve()}
        assert files <= listed, f"{directory}: manifests not in kustomization.yaml: {sorted(files - listed)}"


def test_the_layout(docs) -> None:
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in docs)
    for service in SERVICES:
        for kind in ("Deployment", "Service", "PodDisruptionBudget"):
            assert (kind, f"tandem-{service}") in kinds
    assert ("PersistentVolumeClaim", "tandem-models") in kinds


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_document_validates_strictly_against_the_kubernetes_schemas(docs, version) -> None:
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            raise AssertionError(f"{doc['kind']}/{doc['metadata']['name']} (Kubernetes {version}): {error}") from error


def test_the_strict_validation_catches_an_unknown_field() -> None:
    # The property the test above relies on: a misspelt field is an error, not ignored.
    doc = copy.deepcopy(find(rendered("base"), "Deployment", "tandem-target"))
    doc["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"grpc": {"port": 50053}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSIONS[0], strict=True)


def test_process_env_names_are_read_by_the_code() -> None:
    for name, module in PROCESS_ENV.items():
        assert f'"{name}"' in Path(module.__file__).read_text(), f"{module.__name__} no longer reads {name}"


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_commands_parse_and_the_environment_is_read_by_the_settings(docs, service, monkeypatch) -> None:
    container = container_of(docs, service)
    assert container["command"][:2] == ["tandem", service]
    args = cli.build_parser().parse_args(container["command"][1:] + container.get("args", []))
    assert args.command == service and args.settings_cls is SERVICES[service]

    accepted = {f"TANDEM_{name.upper()}" for name in SERVICES[service].model_fields} | set(PROCESS_ENV)
    env = container_env(docs, container)
    tandem_names = {name for name in env if name.startswith("TANDEM_")}
    assert tandem_names, "no TANDEM_* settings reach the container"
    assert tandem_names <= accepted, f"tandem {service} reads no {sorted(tandem_names - accepted)}"
    others = set(env) - tandem_names
    assert {name for name in others if not name.startswith("OTEL_")} == set(), f"unexpected variables {others}"
    assert env["OTEL_SERVICE_NAME"] == f"tandem-{service}"

    # The values parse too: the settings tandem <service> would build from them.
    settings = settings_of(docs, service, monkeypatch)
    assert settings.host == "0.0.0.0"
    for name, value in env.items():
        field = name.removeprefix("TANDEM_").lower()
        if field in settings.model_fields:
            read = getattr(settings, field)
            read = str(read).lower() if isinstance(read, bool) else str(read)
            assert read == value, f"{name}={value!r} is not what tandem {service} reads"


def test_the_services_share_the_model_and_k(docs, monkeypatch) -> None:
    settings = {service: settings_of(docs, service, monkeypatch) for service in SERVICES}
    assert len({s.target_model for s in settings.values()}) == 1
    assert settings["draft"].num_speculative_tokens == settings["gateway"].num_speculative_tokens


def test_no_service_links_in_the_settings_namespace(docs) -> None:
    # Kubernetes would inject TANDEM_GATEWAY_PORT=tcp://... style variables for each Service:
    # the settings' own namespace (a Service named "tandem" would set TANDEM_PORT).
    for service in SERVICES:
        assert _pod_specs(deployment_of(docs, service))[0]["enableServiceLinks"] is False


@pytest.mark.parametrize(
    ("client", "field", "upstream"),
    [("gateway", "target_address", "target"), ("gateway", "draft_address", "draft"), ("draft", "target_address", "target")],
)
def test_addresses_name_the_headless_services(docs, client, field, upstream, monkeypatch) -> None:
    address = getattr(settings_of(docs, client, monkeypatch), field)
    upstream_port = settings_of(docs, upstream, monkeypatch).port
    host, port = re.fullmatch(r"([a-z0-9-]+):(\d+)", address).groups()
    service = find(docs, "Service", host)
    assert service["spec"].get("clusterIP") == "None", f"{host} must be headless (the gateway balances over pods)"
    assert service["spec"]["selector"] == deployment_of(docs, upstream)["spec"]["selector"]["matchLabels"]
    # Headless: clients connect to the pods' own port, so the Service port must be that port.
    ports = {p["port"]: p for p in service["spec"]["ports"]}
    assert int(port) in ports, f"{address}: {host} has no port {port}"
    container = container_of(docs, upstream)
    target_port = ports[int(port)]["targetPort"]
    target_port = container_port(container, target_port) if isinstance(target_port, str) else target_port
    assert target_port == int(port)
    assert container_port(container, "grpc") == int(port) == upstream_port


def test_the_gateway_service_reaches_the_gateway_ports(docs, monkeypatch) -> None:
    settings = settings_of(docs, "gateway", monkeypatch)
    container = container_of(docs, "gateway")
    assert container_port(container, "http") == settings.http_port
    assert container_port(container, "grpc") == settings.grpc_port
    service = find(docs, "Service", "tandem-gateway")
    assert service["spec"].get("clusterIP") != "None"
    assert service["spec"]["selector"] == deployment_of(docs, "gateway")["spec"]["selector"]["matchLabels"]
    ports = {p["port"]: p["targetPort"] for p in service["spec"]["ports"]}
    assert {port: container_port(container, name) for port, name in ports.items()} == {
        settings.http_port: settings.http_port, settings.grpc_port: settings.grpc_port}


def test_selectors_pick_their_own_pods(docs) -> None:
    for service in SERVICES:
        deployment = deployment_of(docs, service)
        selector = deployment["spec"]["selector"]["matchLabels"]
        assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
        for other in set(SERVICES) - {service}:
            labels = deployment_of(docs, other)["spec"]["template"]["metadata"]["labels"]
            assert not selector.items() <= labels.items(), f"tandem-{service}'s selector picks {other} pods"
        assert find(docs, "PodDisruptionBudget", f"tandem-{service}")["spec"]["selector"]["matchLabels"] == selector


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_probes_ask_the_grpc_health_service(docs, service, monkeypatch) -> None:
    settings = settings_of(docs, service, monkeypatch)
    grpc_port = settings.grpc_port if service == "gateway" else settings.port
    container = container_of(docs, service)
    tls = settings.tls_cert is not None

    def asks_health(probe: dict) -> bool:
        """Kubernetes' own gRPC probe, or (it speaks plaintext only) the healthcheck module in the
        container, which dials with the container's TLS settings."""
        if tls:
            return "grpc" not in probe and probe["exec"]["command"] == [
                "python", "-m", "tandem.rpc.healthcheck", f"127.0.0.1:{grpc_port}"]
        return probe["grpc"] == {"port": grpc_port}

    assert asks_health(container["readinessProbe"])
    if service == "gateway":
        # Its health follows its upstreams (SERVING only while target and draft are): as liveness
        # it would restart every gateway whenever the draft or the target is down or loading.
        for probe in ("livenessProbe", "startupProbe"):
            assert "grpc" not in container[probe]
            assert container[probe]["httpGet"]["path"] == "/metrics"
            assert container[probe]["httpGet"].get("scheme", "HTTP") == ("HTTPS" if settings.http_tls_cert else "HTTP")
            assert container_port(container, container[probe]["httpGet"]["port"]) == settings.http_port
    else:
        assert asks_health(container["livenessProbe"])
        # The first start converts the GGUF (and builds CPU kernels): minutes, not seconds.
        startup = container["startupProbe"]
        assert asks_health(startup)
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 600


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_prometheus_scrapes_the_metrics_port(docs, service, monkeypatch) -> None:
    settings = settings_of(docs, service, monkeypatch)
    port = settings.http_port if service == "gateway" else settings.metrics_port
    annotations = deployment_of(docs, service)["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": str(port),
                           "prometheus.io/path": "/metrics"}
    assert port in {p["containerPort"] for p in container_of(docs, service)["ports"]}


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_the_cache_is_a_writable_volume(docs, service, monkeypatch) -> None:
    settings_of(docs, service, monkeypatch)
    cache = os.environ["TANDEM_CACHE_DIR"]
    pod = _pod_specs(deployment_of(docs, service))[0]
    mounts = {m["mountPath"]: m["name"] for m in container_of(docs, service)["volumeMounts"]}
    volume = {v["name"]: v for v in pod["volumes"]}[mounts[cache]]
    uid = re.search(r"--uid (\d+)", (REPO / "Dockerfile").read_text()).group(1)
    assert pod["securityContext"]["fsGroup"] == int(uid)
    if service == "target":
        claim = volume["persistentVolumeClaim"]["claimName"]
        find(docs, "PersistentVolumeClaim", claim)
        assert deployment_of(docs, service)["spec"]["strategy"]["type"] == "Recreate"  # ReadWriteOnce
    else:
        assert "emptyDir" in volume


def _gpus(container: dict) -> list:
    resources = container.get("resources", {})
    return [resources.get(part, {}).get(GPU) for part in ("requests", "limits") if GPU in resources.get(part, {})]


def test_the_base_target_asks_for_one_gpu(monkeypatch) -> None:
    docs = rendered("base")
    assert _gpus(container_of(docs, "target")) == [1, 1]
    assert settings_of(docs, "target", monkeypatch).device == "cuda"
    assert _gpus(container_of(docs, "draft")) == _gpus(container_of(docs, "gateway")) == []
    assert {container_of(docs, s)["image"] for s in SERVICES} == {"tandem:gpu"}


def test_the_cpu_overlay_asks_for_no_gpu(monkeypatch) -> None:
    docs = rendered("cpu")
    for service in SERVICES:
        assert _gpus(container_of(docs, service)) == []
        assert container_of(docs, service)["image"] == "tandem:cpu"
        assert "tolerations" not in _pod_specs(deployment_of(docs, service))[0]
    assert GPU not in yaml.safe_dump_all(docs)
    # The gateway computes nothing on a device; the target and the draft run on the CPU.
    assert settings_of(docs, "target", monkeypatch).device == settings_of(docs, "draft", monkeypatch).device == "cpu"


def test_the_renderer_applies_json_patches() -> None:
    doc = {"a": {"b/c": 1, "list": [1, 2]}}
    _json_patch(doc, [{"op": "remove", "path": "/a/b~1c"}, {"op": "add", "path": "/a/list/-", "value": 3},
                      {"op": "replace", "path": "/a/list/0", "value": 0}, {"op": "add", "path": "/d", "value": {}}])
    assert doc == {"a": {"list": [0, 2, 3]}, "d": {}}
    with pytest.raises(AssertionError):
        _json_patch(doc, [{"op": "remove", "path": "/a/missing"}])
    with pytest.raises(AssertionError):
        _json_patch(doc, [{"op": "replace", "path": "/a/list/5", "value": 1}])


def test_the_tls_overlay_mounts_the_secret_and_every_service_reads_its_certificate(monkeypatch) -> None:
    docs = rendered("cpu-tls")
    for service in SERVICES:
        settings = settings_of(docs, service, monkeypatch)
        assert not settings.insecure and settings.host == "0.0.0.0"
        assert {settings.tls_cert, settings.tls_key, settings.tls_ca} == {
            f"{TLS_MOUNT}/tls.crt", f"{TLS_MOUNT}/tls.key", f"{TLS_MOUNT}/ca.crt"}
        pod = _pod_specs(deployment_of(docs, service))[0]
        volume = {v["name"]: v for v in pod["volumes"]}["tls"]
        assert volume["secret"]["secretName"] == "tandem-tls"
        mounts = {m["mountPath"]: m for m in container_of(docs, service)["volumeMounts"]}
        assert mounts[TLS_MOUNT]["name"] == "tls" and mounts[TLS_MOUNT]["readOnly"] is True
    gateway = settings_of(docs, "gateway", monkeypatch)
    assert gateway.http_tls_cert == f"{TLS_MOUNT}/tls.crt" and gateway.http_tls_key == f"{TLS_MOUNT}/tls.key"
    # The base keeps plaintext on the pod network, and says so (tandem refuses it otherwise).
    assert settings_of(rendered("cpu"), "target", monkeypatch).insecure
