"""The one board catalog (model/boards.py) is what the inventory, the config schema and the simulator use."""

from __future__ import annotations

from vgpuhost.io.catalog import load_catalog
from vgpuhost.io.sysfs import Sysfs
from vgpuhost.model.boards import BOARDS, board
from vgpuhost.observe.inventory import discover
from vgpuhost.policy.config import board_names, board_tables


def test_every_simulated_board_is_a_known_board_with_its_framebuffer():
    cat = load_catalog()
    assert cat.gpus
    for model in cat.gpus.values():
        known = board(model.ids.device)
        assert known is not None, model.key
        assert model.framebuffer_mib == known.framebuffer_mib


def test_config_tables_and_names_come_from_the_one_catalog():
    tables = board_tables()
    assert set(tables) == {m.ids.device for m in load_catalog().gpus.values()}
    assert set(tables) <= set(BOARDS)
    assert "a100-pcie-40gb" in board_names(0x20f1) and "a100" in board_names(0x20f1)
    assert "geforce rtx 4090" in board_names(0x2684)      # a known board without simulator tables


def test_inventory_names_a_simulated_gpu_as_the_catalog_does(make_host):
    host = make_host("h200-mig")
    inv = discover(Sysfs(host), with_types=False)
    assert inv.gpus
    for g in inv.gpus:
        assert g.model == BOARDS[g.pci.device].product and g.framebuffer_mib == BOARDS[g.pci.device].framebuffer_mib
