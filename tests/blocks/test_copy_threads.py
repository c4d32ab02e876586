"""Background copy threads run torch copies single-threaded without touching other threads."""

from __future__ import annotations

import threading

import torch

from kvwire.blocks.paged_cache import copy_on_this_thread_only


def threads_seen_by(target_setup: bool) -> int:
    seen: list[int] = []

    def run() -> None:
        if target_setup:
            copy_on_this_thread_only()
        seen.append(torch.get_num_threads())

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return seen[0]


def test_the_calling_thread_copies_alone():
    assert threads_seen_by(target_setup=True) == 1


def test_the_main_thread_and_threads_started_later_keep_their_setting():
    before = torch.get_num_threads()
    threads_seen_by(target_setup=True)
    assert torch.get_num_threads() == before
    assert threads_seen_by(target_setup=False) == before
