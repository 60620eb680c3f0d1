import io
import json
import tarfile

from nebula_engine.workloads.registry import load_workload
from nebula_engine.workloads.request import SegmentKind
from nebula_engine.workloads.segments import LoadOptions
from nebula_engine.workloads.swe_agent import MINI_SWE_ARCHIVE, load_swe_agent, read_messages

P, R, C = SegmentKind.PREFIX, SegmentKind.REGULAR, SegmentKind.PIC


def mini_trajectory(task: str) -> dict:
    return {"messages": [
        {"role": "system", "content": "You are a helpful assistant that can run bash."},
        {"role": "user", "content": f"Fix: {task}"},
        {"role": "assistant", "content": "ls"},
        {"role": "user", "content": [{"type": "text", "text": "setup.py src tests"}]},
        {"role": "assistant", "content": "cat setup.py"},
    ]}


def write_archive(directory, trajectories: dict[str, dict]) -> None:
    with tarfile.open(directory / MINI_SWE_ARCHIVE, "w:gz") as archive:
        for name, trajectory in trajectories.items():
            data = json.dumps(trajectory).encode()
            info = tarfile.TarInfo(f"trajs/{name}/{name}.traj.json")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))


def test_read_messages_flattens_content_parts():
    assert read_messages(mini_trajectory("x"))[3] == ("user", "setup.py src tests")


def test_request_per_assistant_message_with_observations_as_pic(tmp_path):
    write_archive(tmp_path, {"a__a-1": mini_trajectory("bug one"), "b__b-2": mini_trajectory("bug two")})
    requests = load_swe_agent(tmp_path, LoadOptions())
    assert len(requests) == 4 and {r.session_id for r in requests} == {"swe-a__a-1", "swe-b__b-2"}
    longest = max(requests, key=lambda r: len(r.segments))
    assert [s.kind for s in longest.segments] == [P, R, R, C]
    systems = {r.segments[0].content_id for r in requests}
    assert len(systems) == 1  # one shared system prompt


def test_limit_bounds_trajectories_read_from_the_archive(tmp_path):
    write_archive(tmp_path, {f"t__t-{i}": mini_trajectory(str(i)) for i in range(5)})
    assert len({r.session_id for r in load_swe_agent(tmp_path, LoadOptions(limit=2))}) == 2


def test_real_traj_files_and_archive(shared_traces):
    demos = load_workload("swe-agent", shared_traces, limit=13)
    assert len({r.session_id for r in demos}) == 13
    assert all(r.segments[0].kind is P for r in demos)
    mixed = load_workload("swe-agent", shared_traces, limit=15)
    assert len({r.session_id for r in mixed}) == 15
    assert any(r.segments[-1].kind is C for r in mixed)
