"""A trajectory's uid is random and never reads as a command-line option."""

from __future__ import annotations

from trajbus.gateway.state import lifecycle


def test_a_uid_beginning_with_a_dash_is_drawn_again(monkeypatch):
    drawn = iter(["-xKTZpnheQ7u6Xb_yAAw65fG", "--TZpnheQ7u6Xb_yAAw65fG", "xKTZpnheQ7u6Xb_yAAw65fG-"])
    monkeypatch.setattr(lifecycle.secrets, "token_urlsafe", lambda size: next(drawn))
    assert lifecycle.new_trajectory_uid() == "xKTZpnheQ7u6Xb_yAAw65fG-"


def test_uids_are_144_random_bits_url_safe():
    uids = {lifecycle.new_trajectory_uid() for _ in range(2000)}
    assert len(uids) == 2000 and all(len(u) == 24 and not u.startswith("-") for u in uids)
    assert set("".join(uids)) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
