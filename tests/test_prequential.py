from genrec.app.prequential import Published, ReplayedEvent, prequential_figures


def test_each_event_is_scored_against_the_answer_to_the_previous_event():
    events = [
        ReplayedEvent("e1", "u", "a", 0),
        ReplayedEvent("e2", "u", "b", 10),
        ReplayedEvent("e3", "u", "c", 20),
        ReplayedEvent("f1", "v", "x", 30),
    ]
    published = [
        Published(["e1"], {"merged": ["b"], "popularity": ["z"]}, 15, "e1"),
        Published(["e2"], {"merged": ["q"], "popularity": ["c"]}, 40, "e2"),
        Published(["f1"], {"merged": ["y"], "popularity": ["y"]}, 50, "f1"),
    ]
    figures = prequential_figures(events, published, k=10)
    assert figures["events_evaluated"] == 2  # e2 and e3; first events have no earlier answer
    assert figures["hit_rate_at_10"] == {"merged": 0.5, "popularity": 0.5}
    assert figures["latency_ms"]["p50"] == 20.0  # 15-0, 40-10, 50-30
    assert figures["recommendations"] == 3


def test_a_coalesced_answer_is_never_scored_on_an_event_it_saw():
    events = [
        ReplayedEvent("e1", "u", "a", 0),
        ReplayedEvent("e2", "u", "b", 1),
        ReplayedEvent("e3", "u", "c", 2),
    ]
    # e2 and e3 were answered together; the answer to e1 is the newest that did not see e3.
    published = [
        Published(["e1"], {"merged": ["b", "c"]}, 5, "e1"),
        Published(["e2", "e3"], {"merged": ["c"]}, 9, "e3"),
    ]
    figures = prequential_figures(events, published, k=1)
    assert figures["events_evaluated"] == 2
    assert figures["hit_rate_at_1"]["merged"] == 0.5  # e2 hit by ["b"], e3 scored on ["b"] too
