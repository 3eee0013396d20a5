"""The hottest objects and datasets: decayed rates in bounded space (gateway/hot.py)."""

from __future__ import annotations

from chunkd.gateway.hot import MAX_DATASETS, HotSet


def test_a_scan_of_100k_objects_stays_within_the_bound_and_the_hot_ones_stay_on_top() -> None:
    hot = HotSet(capacity=1024)
    for second in range(5):
        for i in range(100_000):  # a listing-sized scan, every second
            hot.add("data", f"shards/{second}/{i:06d}.parquet", 4096)
        for _ in range(200):
            hot.add("data", "hot/a.bin", 4 << 20)
            hot.add("data", "hot/b.bin", 1 << 20)
        top = hot.tick(1.0)
        # within a second at most 4x capacity new names were taken; after the tick, capacity
        assert len(hot._objects) <= 1024
    names = [entry["name"] for entry in top["objects"]]
    assert names[:2] == ["data/hot/a.bin", "data/hot/b.bin"]
    assert len(top["objects"]) == 10
    assert top["objects"][0]["bytes"] > top["objects"][1]["bytes"] > 0


def test_reads_count_towards_the_dataset_whose_prefix_holds_them_and_cold_ones_go() -> None:
    hot = HotSet()
    hot.dataset("data", "text/web/", "web")
    hot.dataset("data", "text/web/en", "web-en")  # deeper: wins for its keys
    hot.add("data", "text/web/en/part-0.parquet", 1000)
    hot.add("data", "text/web/fr/part-0.parquet", 500)
    hot.add("other", "text/web/en/part-0.parquet", 999)  # another backend: no dataset
    top = hot.tick(1.0)
    by_name = {d["name"]: d for d in top["datasets"]}
    assert set(by_name) == {"web", "web-en"}
    assert by_name["web-en"]["bytes"] > by_name["web"]["bytes"]
    for _ in range(400):  # nothing read for 400 s: all of it goes cold and is dropped
        top = hot.tick(1.0)
    assert top == {"objects": [], "datasets": []}
    for i in range(MAX_DATASETS + 50):
        hot.dataset("data", f"d{i}", f"d{i}")
    assert len(hot._prefixes) == MAX_DATASETS
