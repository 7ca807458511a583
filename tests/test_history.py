from genrec.offline.history import load_item_ids, load_user_histories


def test_ml100k_histories_are_stably_time_ordered(ml100k_engine):
    histories = load_user_histories(ml100k_engine)
    assert len(histories) == 943
    assert sum(len(h) for h in histories.values()) == 100_000
    assert len(load_item_ids(ml100k_engine)) == 1682
    for history in histories.values():
        stamps = [event.ts_ms for event in history]
        assert stamps == sorted(stamps)
        # ties keep file order: event ids carry the source file row
        for a, b in zip(history, history[1:], strict=False):
            if a.ts_ms == b.ts_ms:
                assert int(a.event_id.rsplit("-", 1)[1]) < int(b.event_id.rsplit("-", 1)[1])
