"""Catalog planning without a farm (producer/catalog/): reading CSV and JSON Lines, templates,
content keys and derived seeds, per-item parameters and the errors that name the item."""

from __future__ import annotations

import json

import pytest

from producer.catalog import (
    CatalogError,
    Template,
    content_key,
    derive_seed,
    plan_item,
    plan_items,
    prepare_catalog,
    read_catalog,
)

DEFAULTS = {"model": "tiny", "width": 64, "height": 64, "num_inference_steps": 2}


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_csv_items_with_lines_and_ids(tmp_path):
    path = _write(tmp_path, "c.csv", "id,name,color\nsku-1,mug,red\nsku-2,\"tea, pot\",blue\n\nsku-3,cup,\n")
    fmt, items = read_catalog(path)
    assert fmt == "csv" and [i.id for i in items] == ["sku-1", "sku-2", "sku-3"]
    assert [i.line for i in items] == [2, 3, 5]
    assert items[1].fields["name"] == "tea, pot" and "color" not in items[2].fields  # empty cell = absent


def test_jsonl_is_sniffed_without_extension_and_bad_lines_fail_alone(tmp_path):
    path = _write(tmp_path, "catalog.txt", '{"name": "fox", "seed": 7}\n\nnot json\n[1, 2]\n{"name": "owl"}\n')
    fmt, items = read_catalog(path)
    assert fmt == "jsonl" and len(items) == 4
    assert items[0].fields == {"name": "fox", "seed": 7} and items[0].id == "line 1"
    assert "not valid JSON" in items[1].problem and items[1].line == 3
    assert "not an object" in items[2].problem
    plans = plan_items(items, Template("a {name}"), DEFAULTS)
    assert [p.error["type"] if p.error else None for p in plans] == [None, "InvalidItem", "InvalidItem", None]


def test_unusable_catalogs_are_fatal(tmp_path):
    with pytest.raises(CatalogError, match="does not exist"):
        read_catalog(tmp_path / "missing.csv")
    with pytest.raises(CatalogError, match="duplicate columns"):
        read_catalog(_write(tmp_path, "d.csv", "name,name\na,b\n"))
    with pytest.raises(CatalogError, match="holds no items"):
        read_catalog(_write(tmp_path, "e.jsonl", "\n\n"))


@pytest.mark.parametrize("template, needle", [
    ("a {}", "positional"), ("a {0}", "positional"), ("a {name.upper}", "attribute or index"),
    ("a {name[0]}", "attribute or index"), ("a {name:{width}}", "nested"), ("a {name", "expected '}'"),
])
def test_template_rejects_unsafe_or_broken_placeholders(template, needle):
    with pytest.raises(CatalogError, match=needle):
        Template(template)


def test_item_missing_a_template_field_names_the_item_line_and_field(tmp_path):
    path = _write(tmp_path, "m.jsonl", '{"id": "a", "name": "fox", "color": "red"}\n{"id": "b", "name": "owl"}\n')
    _, items = read_catalog(path)
    ok, missing = plan_items(items, Template("a {name}, {color}"), DEFAULTS)
    assert ok.error is None and ok.request.prompt == "a fox, red"
    assert missing.error["type"] == "TemplateError"
    assert "'b'" in missing.error["message"] and "line 2" in missing.error["message"]
    assert "'color'" in missing.error["message"]


def test_a_field_no_item_has_is_fatal(tmp_path):
    path = _write(tmp_path, "c.csv", "name\nfox\n")
    with pytest.raises(CatalogError, match="no item has a field 'colour'"):
        prepare_catalog(path, "a {name}, {colour}", model="tiny")


def test_keys_and_seeds_are_stable_and_content_addressed(tmp_path):
    path = _write(tmp_path, "c.csv", "name,color\nfox,red\nowl,grey\n")
    plans1, _ = prepare_catalog(path, "a {name}, {color}", model="tiny", params=DEFAULTS)
    plans2, _ = prepare_catalog(path, "a {name}, {color}", model="tiny", params=DEFAULTS)
    assert [p.key for p in plans1] == [p.key for p in plans2] and len({p.key for p in plans1}) == 2
    assert [p.request.seed for p in plans1] == [derive_seed(p.request) for p in plans1]
    # a change to one item changes only its key
    _write(tmp_path, "c.csv", "name,color\nfox,red\nowl,white\n")
    plans3, _ = prepare_catalog(path, "a {name}, {color}", model="tiny", params=DEFAULTS)
    assert plans3[0].key == plans1[0].key and plans3[1].key != plans1[1].key
    # every parameter and the model are part of the key; metadata is not
    base = plans1[0].request
    for change in ({"width": 128}, {"num_inference_steps": 3}, {"guidance_scale": 1.0}, {"model": "other"},
                   {"seed": base.seed + 1}, {"negative_prompt": "blur"}, {"output_format": "webp"}):
        assert content_key(base.model_copy(update=change)) != plans1[0].key, change
    assert content_key(base.model_copy(update={"metadata": {}})) == plans1[0].key
    assert plans1[0].request.metadata["catalog_key"] == plans1[0].key


def test_item_fields_set_parameters_and_invalid_ones_fail_with_the_rule(tmp_path):
    lines = [{"name": "fox", "seed": 11, "width": 128, "steps": 3}, {"name": "owl", "width": "100"},
             {"name": "cat", "negative_prompt": "dogs"}, {"name": "bat", "seed": "x"}]
    path = _write(tmp_path, "p.jsonl", "\n".join(json.dumps(x) for x in lines) + "\n")
    fox, owl, cat, bat = prepare_catalog(path, "a {name}", model="tiny", params=DEFAULTS,
                                         negative_template="not {name}")[0]
    assert (fox.request.seed, fox.request.width, fox.request.num_inference_steps) == (11, 128, 3)
    assert owl.error == {"type": "ValidationError", "message": "width: Value error, width must be a multiple of 8, "
                                                               "got 100"}
    assert cat.request.negative_prompt == "dogs" and fox.request.negative_prompt == "not fox"
    assert bat.error["type"] == "ValidationError" and bat.error["message"].startswith("seed:")


def test_format_spec_errors_fail_the_item_not_the_run(tmp_path):
    _, items = read_catalog(_write(tmp_path, "f.csv", "name,price\nfox,3\n"))
    plan = plan_item(items[0], Template("a {name} for {price:.2f}"), DEFAULTS)
    assert plan.error["type"] == "TemplateError" and "line 2" in plan.error["message"]


# ---- the run loop against a fake client (no farm) -------------------------------------------
class _FakeClient:
    """Answers lookups from ``known``; refuses the first submission with ``refuse_first`` (status,
    detail, retry_after), splits nothing itself; every batch is done at once, all succeeded."""

    def __init__(self, known=None, refuse=()):
        from producer.client import RenderFarmError

        self.known, self.refuse, self.submitted, self.error = known or {}, list(refuse), [], RenderFarmError
        self.jobs = {}

    def catalog_lookup(self, keys):
        return {k: self.known.get(k) for k in keys}

    def submit_batch(self, requests, *, priority, idempotency_key):
        from infra.schemas import BatchAccepted

        if self.refuse:
            status, detail, retry_after = self.refuse.pop(0)
            if status != 413 or len(requests) > 1:
                raise self.error(status, detail, retry_after)
        batch_id = f"b{len(self.submitted)}"
        self.submitted.append((batch_id, [r.metadata["catalog_key"] for r in requests], idempotency_key))
        ids = [f"{batch_id}-j{i}" for i in range(len(requests))]
        self.jobs[batch_id] = [(j, r) for j, r in zip(ids, requests)]
        return BatchAccepted(batch_id=batch_id, job_ids=ids)

    def batch(self, batch_id, limit=0):
        from types import SimpleNamespace

        n = len(self.jobs[batch_id])
        return SimpleNamespace(done=True, counts={"succeeded": n})

    def batch_jobs(self, batch_id):
        from types import SimpleNamespace

        return [SimpleNamespace(job_id=j, state="succeeded", error=None) for j, _ in self.jobs[batch_id]]


def _plans(tmp_path, n=4):
    path = _write(tmp_path, "c.csv", "name\n" + "".join(f"thing{i}\n" for i in range(n)))
    return prepare_catalog(path, "a {name}", model="tiny", params=DEFAULTS)[0]


def test_state_dir_records_skip_only_what_the_farm_confirms(tmp_path):
    """The farm's side (a HEAD of each image, a real deleted object) is
    tests/integration/test_catalog.py::test_state_dir_skips_only_items_whose_image_the_farm_confirms."""
    from producer.catalog import CatalogRun, StateDir

    plans = _plans(tmp_path)
    state = StateDir(tmp_path / "state")
    state.add([(p.key, f"job-{i}") for i, p in enumerate(plans)])
    with state.file.open("a") as f:
        f.write('{"key": "torn')  # an interrupted write
    assert set(state.load()) == {p.key for p in plans}
    # the farm confirms three images; the fourth is gone (the lookup answers None)
    client = _FakeClient({p.key: {"job_id": f"job-{i}", "batch_id": "x", "state": "succeeded"}
                          for i, p in enumerate(plans[:3])})
    report = CatalogRun(client, plans, state=state, poll_s=0.01, manifest=False).run().report()
    assert (report["skipped"], report["rendered"]) == (3, 1) and "manifest" not in report
    assert [keys for _, keys, _ in client.submitted] == [[plans[3].key]]
    assert report["state_dir"] == {"recorded": 4, "confirmed": 3, "unconfirmed": 1}
    assert state.load()[plans[3].key] == "b0-j0"  # recorded anew with the job that rendered it again


def test_run_skips_succeeded_resubmits_failed_and_splits_on_413(tmp_path):
    """(429s and restarts are RenderClient's to ride out: tests/security/test_client_retry.py.)"""
    from producer import catalog

    plans = _plans(tmp_path, 6)
    k = [p.key for p in plans]
    known = {k[0]: {"job_id": "old", "batch_id": "x", "state": "succeeded"},
             k[1]: {"job_id": "dead", "batch_id": "x", "state": "failed"}}
    client = _FakeClient(known, refuse=[(413, "too big", None)])
    run = catalog.CatalogRun(client, plans, poll_s=0.01, chunk_size=10).run()
    report = run.report()
    assert (report["rendered"], report["skipped"], report["failed"]) == (5, 1, 0)
    # the 413 split the 5 keys into 2 + 3
    assert sorted(len(keys) for _, keys, _ in client.submitted) == [2, 3]
    assert {key for _, keys, _ in client.submitted for key in keys} == set(k[1:])


def test_a_422_fails_the_items_it_names(tmp_path):
    from producer import catalog

    plans = _plans(tmp_path, 2)
    detail = [{"loc": ["body", "jobs", 1, "model"], "msg": "no declared pool serves model 'tiny'"}]
    client = _FakeClient(refuse=[(422, detail, None)])
    report = catalog.CatalogRun(client, plans, poll_s=0.01).run().report()
    assert report["failed"] == 2
    errors = [f["error"] for f in report["failures"]]
    assert errors[1] == {"type": "Refused", "message": "model: no declared pool serves model 'tiny'"}
    assert errors[0]["message"].startswith("HTTP 422")


def test_upscaling_is_part_of_the_content_key_only_when_asked(tmp_path):
    from infra.schemas import RenderRequest
    from producer.catalog.plan import _canonical

    plain = RenderRequest(prompt="红烧肉", model="tiny", seed=1)
    assert b"upscale" not in _canonical(plain, True)  # keys of catalogs without upscaling are unchanged
    up = plain.model_copy(update={"upscale": 4, "upscaler": "esrgan-x4-arch"})
    assert _canonical(up, True) != _canonical(plain, True)
    assert RenderRequest.model_validate({"prompt": "a", "upscale": "4", "upscaler": "x"}).upscale == 4  # CSV text


def test_a_control_image_column_makes_one_unit_whose_image_is_in_the_key(tmp_path):
    """``control_image`` + ``control_type`` (+ ``control_weight``, ``control_preprocess``): one
    ControlNet unit whose image is the file's content key; the key follows the control image's
    bytes and the unit, and a control image without a type fails its item alone."""
    from PIL import Image

    for name, value in (("edges.png", 0), ("other.png", 255)):
        Image.new("RGB", (8, 8), (value, value, value)).save(tmp_path / name)
    path = _write(tmp_path, "c.csv", "id,name,control_image,control_type,control_weight,control_preprocess\n"
                                     "a,mug,edges.png,canny,0.8,canny\nb,mug,edges.png,canny,,\n"
                                     "c,mug,other.png,canny,0.8,canny\nd,mug,edges.png,,,\ne,mug,,,0.5,\n")
    plans = prepare_catalog(path, "{name}", model="tiny")[0]
    a, b, c, d, e = plans
    [unit] = a.request.controls
    assert (unit.type, unit.weight, unit.preprocess) == ("canny", 0.8, "canny")
    assert unit.image.startswith("inputs/") and unit.image.endswith(".png") and a.inputs[unit.image].name == "edges.png"
    assert b.request.controls[0].weight == 1.0 and b.request.controls[0].image == unit.image
    assert len({a.key, b.key, c.key}) == 3  # the weight and the control image's bytes are in the key
    assert prepare_catalog(path, "{name}", model="tiny")[0][0].key == a.key
    assert d.error["type"] == "InputError" and "needs a control_type" in d.error["message"]
    assert e.error["type"] == "InputError" and "control_weight need a control_image" in e.error["message"]
