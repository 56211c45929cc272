"""The Kubernetes manifests of docs/deployment.md, checked offline where a schema exists.

The Deployment is validated strictly (no unknown fields, every type and required field)
against the Kubernetes OpenAPI schemas that the `kubernetes-validate` package ships, for the
oldest and the newest release it covers here. The Gateway API Inference Extension's
`InferencePool` CRD and the endpoint picker's `EndpointPickerConfig` have no published schema
in any package a registry serves here (PyPI, npm; checked: kubernetes-validate,
@kubernetes-models/gateway-api, llm-d-planner), so they are not validated: the document says so.
"""

from __future__ import annotations

import re

import pytest
import yaml

from testkit import REPO

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is not installed (the test extra has it)")

DOC = REPO / "docs" / "deployment.md"


def manifests() -> list[dict]:
    found = []
    for block in re.findall(r"```yaml\n(.*?)```", DOC.read_text(), re.S):
        found += [obj for obj in yaml.safe_load_all(block) if obj]
    return found


def deployment() -> dict:
    (found,) = [m for m in manifests() if m.get("kind") == "Deployment"]
    return found


@pytest.mark.parametrize("version", ["1.30.0", kubernetes_validate.latest_version()])
def test_the_documented_deployment_is_a_valid_kubernetes_object(version):
    kubernetes_validate.validate(deployment(), version, strict=True)


def test_the_validation_would_catch_a_misspelt_field():
    broken = deployment()
    container = broken["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, "1.30.0", strict=True)


def test_the_document_says_which_manifests_are_not_validated():
    kinds = {m.get("kind") for m in manifests()}
    assert {"Deployment", "InferencePool", "EndpointPickerConfig"} <= kinds
    text = " ".join(DOC.read_text().split())
    assert "InferencePool` and `EndpointPickerConfig` are **not validated**" in text
