import time

from minikv.bench.probes import timed


class Layer:
    def select(self, x):
        time.sleep(0.01)
        return x + 1

    def attend(self, x):
        return x * 2


def test_timed_adds_each_call_and_restores_the_methods():
    layers, totals = [Layer(), Layer()], {}
    with timed(layers, ["select", "attend", "missing"], totals):
        assert [layer.select(1) for layer in layers] == [2, 2]  # results pass through
        assert layers[0].attend(3) == 6
    assert totals["select"] >= 0.02 and totals["attend"] < totals["select"]
    assert "missing" not in totals
    assert "select" not in vars(layers[0])  # the class's method is back
    assert layers[0].select.__func__ is Layer.select


class Step(Layer):
    def decode(self, x):
        return self.select(x)  # a decode step that selects

    def prefill(self, x):
        return self.select(x)  # so does the prefill


def test_only_the_calls_within_a_step_are_timed():
    """speed's probes: a layer's select counts inside its decode (within), not inside its prefill."""
    layer, totals, in_step = Step(), {}, [0]
    with timed([layer], ["select"], totals, only_within=in_step), timed([layer], ["decode"], totals, within=in_step):
        layer.prefill(1)
        assert totals["select"] == 0.0 and in_step == [0]
        assert layer.decode(1) == 2
        assert in_step == [0] and 0.01 <= totals["select"] <= totals["decode"]


def test_timed_restores_after_an_error():
    layer, totals = Layer(), {}
    try:
        with timed([layer], ["select"], totals):
            layer.select("x")  # str + 1 raises
    except TypeError:
        pass
    assert "select" not in vars(layer) and totals["select"] > 0


def test_watched_sees_every_call_with_its_result_and_restores_the_method():
    from minikv.bench.probes import watched

    layer, seen = Layer(), []
    with watched(layer, "attend", lambda result, x: seen.append((x, result))):
        assert layer.attend(3) == 6 and layer.attend(4) == 8  # results pass through
    layer.attend(5)  # after the block: not seen
    assert seen == [(3, 6), (4, 8)]
    assert "attend" not in vars(layer)
    with watched(layer, "missing", lambda *a: seen.append(a)):
        pass  # a method the object lacks: nothing to watch
    assert seen == [(3, 6), (4, 8)]
