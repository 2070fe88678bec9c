"""Play a checkpoint's policy on its own env: `python -m ppo_fabric.evaluate checkpoint=PATH [key=value ...]`.

The env is rebuilt from the config stored in the checkpoint (id, kwargs, time limit, action repeat), so the
returns are the ones training logged, and the model from the checkpoint's model config, so nothing about
the run has to be repeated on the command line. Results go to `eval.json` in the run directory (the
checkpoint's `<run>/checkpoints/..` parent) or `out=DIR`; `video=true` also records the first episode.

Every kind of policy a run trains plays: masked ones get the env's masks, recurrent ones carry their state
through the episode, and a multi-agent (PettingZoo Parallel) checkpoint plays all its policies together and
reports each policy's returns. Two-player turn-based games (PettingZoo AEC) are played with `opponent=`
(`random`, `snapshot:<checkpoint>` or `pool`, the self-play snapshots in the checkpoint) for win / draw /
loss rates over `games` games with seats alternated (`games.play_games`).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from ppo_fabric.config import faults
from ppo_fabric.wire.progress import PROGRESS

USAGE = """usage: python -m ppo_fabric.evaluate checkpoint=PATH [key=value ...]

  checkpoint=PATH       a .ckpt file, or a run directory (its checkpoints/last.ckpt)   (required)
  episodes=10           episodes to play (single-agent and multi-agent runs; a game counts games=)
  deterministic=true    greedy/mean actions (false: sample from the policy)
  seed=0                episode i is reset with seed+i
  video=false           record the first episode as eval.mp4 (needs: pip install 'ppo-fabric[video]')
  out=DIR               where eval.json (and eval.mp4) go; default: the checkpoint's run directory
  opponent=             two-player AEC games: random | snapshot:PATH (a checkpoint) | pool (the checkpoint's
                        self-play snapshots) | win_or_block | search[:DEPTH] (scripted Connect Four players:
                        take a win or block one; a DEPTH-ply search, default 2); reports win / draw / loss
                        rates over `games` games
  games=100             games to play against the opponent (seats alternated; pool: shared among snapshots)
  policy=               multi-agent checkpoints: the policy that plays the game (default: the first trained)
  trust_env=false       build an env whose id names a module outside the known env packages (your own
                        `module:name`): that module's code runs; only for checkpoints you trust
"""

SPEC: dict[str, tuple[type, Any]] = {
    "checkpoint": (str, ...),
    "episodes": (int, None),
    "deterministic": (bool, True),
    "seed": (int, 0),
    "video": (bool, False),
    "out": (str, None),
    "opponent": (str, None),
    "games": (int, None),
    "policy": (str, None),
    "trust_env": (bool, False),
}
VIDEO_HINT = "video=true needs a video encoder: pip install 'ppo-fabric[video]'"


class EvalError(ValueError):
    """Input the evaluation cannot run with; `str()` is one line for the user."""


def _video_writer() -> Any:
    """PyAV, imported up front so a missing extra fails before any episode is played."""
    try:
        import av
    except ImportError as exc:
        raise EvalError(VIDEO_HINT) from exc
    return av


def write_mp4(frames: list[np.ndarray], path: Path, fps: float) -> Path:
    """Encode RGB frames (H, W, 3 uint8) as H.264 mp4 with PyAV.

    PyAV is one self-contained wheel (FFmpeg inside), far lighter than moviepy plus imageio-ffmpeg which
    gymnasium's RecordVideo needs. yuv420p (what every player decodes) needs even sides: odd ones are padded.
    """
    av = _video_writer()
    height, width = frames[0].shape[:2]
    even_h, even_w = height + height % 2, width + width % 2
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=max(1, round(fps)))
        stream.width, stream.height, stream.pix_fmt = even_w, even_h, "yuv420p"
        for frame in frames:
            if frame.shape[:2] != (even_h, even_w):
                frame = np.pad(frame, ((0, even_h - height), (0, even_w - width), (0, 0)), mode="edge")
            container.mux(
                stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24"))
            )
        container.mux(stream.encode())  # flush the encoder
    return path


def capped(env: Any) -> Any:
    """`env` with a time limit where it has none (a `module:factory` env without `env.max_episode_steps`):
    a greedy policy that never reaches a terminal state would otherwise hold the evaluation, and with it
    the run, for ever while every step counts as progress."""
    spec = env.spec
    if spec is not None and spec.max_episode_steps is not None:
        return env
    from gymnasium.wrappers import TimeLimit

    return TimeLimit(env, faults.EVAL_MAX_EPISODE_STEPS)


def play(
    policy: Any,
    env: Any,
    episodes: int,
    deterministic: bool,
    seed: int,
    record_first: bool = False,
) -> tuple[list[float], list[int], list[np.ndarray]]:
    """Run whole episodes with `policy.predict` (a `Policy`); returns (returns, lengths, frames of the
    first episode when recording).

    `predict` does what training did on the env's side: the run's observation statistics, the action mask
    an env puts in its infos (for a policy that trained with it), Box actions clipped, the recurrent state carried across steps (a fresh one per
    episode). With the Atari preprocessing an episode is a whole game with its raw score: a lost life ends
    the learner's episode (and the step's clipped reward is what the policy saw), but the game plays on here.
    """
    from ppo_fabric.envs.atari import records_games

    games = records_games(env)
    returns: list[float] = []
    lengths: list[int] = []
    frames: list[np.ndarray] = []
    for episode in range(episodes):
        obs, info = env.reset(seed=seed + episode)
        recording = record_first and episode == 0
        if recording:
            frames.append(np.asarray(env.render()))
        total, length, done, state = 0.0, 0, False, None
        while not done:
            mask = info.get("action_mask") if policy.mask_width is not None else None  # as it trained
            action, state = policy.predict(obs, state, None, deterministic, mask)
            env_action = int(action) if action.ndim == 0 else action
            obs, reward, terminated, truncated, info = env.step(env_action)
            total += float(reward)
            length += 1
            done = bool(terminated or truncated)
            if games and done:
                if "episode" in info:  # game over: the game's own return and length
                    total, length = float(info["episode"]["r"]), int(info["episode"]["l"])
                else:  # a lost life: the game goes on (a new episode for the learner, so a fresh state)
                    obs, info = env.reset()
                    state, done = None, False
            if recording:
                frames.append(np.asarray(env.render()))
        returns.append(total)
        lengths.append(length)
    return returns, lengths, frames


def evaluate(
    checkpoint: str | Path,
    episodes: int | None = None,
    deterministic: bool = True,
    seed: int = 0,
    video: bool = False,
    out: str | Path | None = None,
    opponent: str | None = None,
    games: int | None = None,
    policy: str | None = None,
    trust_env: bool = False,
) -> dict[str, Any]:
    """Evaluate a checkpoint, write `eval.json` (and `eval.mp4`), and return the results.

    The env is built from the checkpoint's config; one whose id names a module outside the known env
    packages (`envs.make.foreign_module`) would run that module's code, with arguments the checkpoint
    holds, so it is built only with `trust_env` (loading never runs code a checkpoint names).
    Raises EvalError with a one-line message for input that cannot be evaluated. `episodes` (default 10)
    counts episodes, `games` (default 100) games against `opponent`: each given where the other counts was
    ignored, and the user got 100 games after asking for 6.
    """
    from omegaconf import OmegaConf

    from ppo_fabric.envs.make import EnvError, foreign_module, make_env
    from ppo_fabric.policy.trained import checkpoint_policies
    from ppo_fabric.runs import checkpoint as ckpt

    game = opponent is not None or policy is not None
    if game and episodes is not None:
        given = "opponent=" if opponent is not None else "policy="
        raise EvalError(f"episodes={episodes} counts episodes; {given} evaluates a two-player game, whose games "
                        "against an opponent are counted by games= (default 100)")  # fmt: skip
    if not game and games is not None:
        raise EvalError(f"games={games} counts games against an opponent: a two-player game's checkpoint "
                        "takes opponent= too, any other plays episodes= (default 10)")  # fmt: skip
    episodes = 10 if episodes is None else episodes
    games = 100 if games is None else games
    if episodes <= 0:
        raise EvalError(f"episodes={episodes} must be > 0")
    if seed < 0:  # episode i resets with seed + i, which gymnasium refuses below 0
        raise EvalError(f"seed={seed} must be >= 0 (episode i is reset with seed + i)")
    if video:
        _video_writer()
    try:
        state, policies = checkpoint_policies(checkpoint)
    except ValueError as exc:
        raise EvalError(str(exc)) from exc
    out_dir = Path(out) if out is not None else ckpt.run_dir_of(checkpoint)
    if out_dir.exists() and not out_dir.is_dir():  # said before any episode is played
        raise EvalError(f"out={out_dir} is a file; out= names the directory eval.json goes into")
    env_cfg = OmegaConf.create(state["config"]["env"])
    module = foreign_module(str(env_cfg.id))
    if module is not None and not trust_env:
        raise EvalError(
            f"the checkpoint's env.id={str(env_cfg.id)!r} would import and run module {module!r}: loading "
            "never runs code a checkpoint names; add trust_env=true if you trust this checkpoint"
        )
    if game:
        if video:
            raise EvalError("video=true records single-agent episodes; drop it for games")
        from ppo_fabric.policy.game_eval import GameEvalError, evaluate_games

        try:
            models = {name: p.model for name, p in policies.items()}
            result = evaluate_games(state, models, checkpoint, opponent, games, deterministic, seed, policy)
        except GameEvalError as exc:
            raise EvalError(str(exc)) from exc
        return _write(result, out_dir)
    if state.get("multiagent"):
        if video:
            raise EvalError("video=true records single-agent episodes; drop it for multi-agent checkpoints")
        result = evaluate_multiagent(state, policies, checkpoint, episodes, deterministic, seed)
        return _write(result, out_dir)
    main_policy = policies["main"]
    if video:  # frames are drawn off-screen: keep SDL (pygame envs) from probing for a display or sound
        os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
        os.environ.setdefault("SDL_AUDIODRIVER", "dummy")
    try:
        # A run with action masks (the checkpoint records their width): the env reports them again.
        env = capped(
            make_env(
                env_cfg, render_mode="rgb_array" if video else None, action_mask=state.get("action_mask")
            )
        )
    except EnvError as exc:
        raise EvalError(str(exc)) from exc
    if video and "rgb_array" not in env.metadata.get("render_modes", []):
        env.close()
        raise EvalError(f"env.id={env_cfg.id!r} cannot render rgb_array frames; evaluate with video=false")
    start = time.perf_counter()
    try:
        returns, lengths, frames = play(main_policy, env, episodes, deterministic, seed, record_first=video)
        fps = float(env.metadata.get("render_fps") or 30)
    finally:
        env.close()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        video_path = write_mp4(frames, out_dir / "eval.mp4", fps) if video else None
    except OSError as exc:
        raise EvalError(f"out={out_dir}: cannot write there ({exc.strerror or type(exc).__name__})") from exc
    result = {
        **_run_summary(checkpoint, env_cfg, state, episodes, deterministic, seed, returns, lengths),
        "returns": returns,
        "wall_seconds": time.perf_counter() - start,
        "video": None if video_path is None else str(video_path),
    }
    return _write(result, out_dir)


def _write(result: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    from ppo_fabric.runs.metrics_file import write_json

    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        write_json(out_dir / "eval.json", result)
    except OSError as exc:
        raise EvalError(
            f"out={out_dir}: cannot write eval.json there ({exc.strerror or type(exc).__name__})"
        ) from exc
    result["eval_json"] = str(out_dir / "eval.json")
    return result


def _run_summary(
    checkpoint: Any,
    env_cfg: Any,
    state: dict[str, Any],
    episodes: int,
    deterministic: bool,
    seed: int,
    returns: list[float],
    lengths: list[int],
) -> dict[str, Any]:
    """What every eval.json opens with: what was evaluated, how, and the returns over all episodes."""
    from ppo_fabric.runs import checkpoint as ckpt

    return {
        "checkpoint": str(ckpt.resolve(checkpoint).resolve()),
        "env_id": str(env_cfg.id),
        "env_step": state.get("env_step"),
        "episodes": episodes,
        "deterministic": deterministic,
        "seed": seed,
        **_returns_summary(returns),
        "mean_length": float(np.mean(lengths)),
        "lengths": lengths,
    }


def _returns_summary(returns: list[float]) -> dict[str, float]:
    return {
        "mean_return": float(np.mean(returns)),
        "std_return": float(np.std(returns)),  # population std (ddof=0), as SB3's evaluate_policy
        "min_return": float(np.min(returns)),
        "max_return": float(np.max(returns)),
    }


# ------------------------------------------------------------------------------------------ multi-agent
def play_parallel(
    policies: dict[str, Any],
    groups: dict[str, list[str]],
    env: Any,
    episodes: int,
    deterministic: bool,
    seed: int,
) -> tuple[dict[str, list[float]], list[int]]:
    """Whole episodes of a PettingZoo Parallel env with each agent acting by its policy's `predict`;
    returns (policy -> every agent's return of every episode, episode lengths). Each agent carries its own
    recurrent state (a fresh one per episode), as in training; an agent that left the episode stops
    acting. A policy trained with masks reads them from the `action_mask` key of a Dict observation. An
    episode ends after `faults.EVAL_MAX_EPISODE_STEPS` steps if its agents have not all left by then."""
    from ppo_fabric.games.play import split_observation

    policy_of = {agent: p for p, agents in groups.items() for agent in agents}
    returns: dict[str, list[float]] = {p: [] for p in groups}
    lengths: list[int] = []
    for episode in range(episodes):
        obs, _ = env.reset(seed=seed + episode)
        totals = dict.fromkeys(policy_of, 0.0)
        states: dict[str, Any] = {}
        length = 0
        while env.agents and length < faults.EVAL_MAX_EPISODE_STEPS:
            actions = {}
            for agent in env.agents:
                policy = policies[policy_of[agent]]
                observation, mask = obs[agent], None
                if policy.mask_width is not None:
                    observation, mask = split_observation(observation)
                action, states[agent] = policy.predict(
                    observation, states.get(agent), None, deterministic, mask
                )
                actions[agent] = int(action) if action.ndim == 0 else action
            PROGRESS.mark(
                "evaluation env.step"
            )  # the stall watchdog's heartbeat (evaluation during training)
            obs, rewards, _, _, _ = env.step(actions)
            for agent, reward in rewards.items():
                totals[agent] += float(reward)
            length += 1
        for agent, total in totals.items():
            returns[policy_of[agent]].append(total)
        lengths.append(length)
    return returns, lengths


def evaluate_multiagent(
    state: dict[str, Any],
    policies: dict[str, Any],
    checkpoint: str | Path,
    episodes: int,
    deterministic: bool,
    seed: int,
) -> dict[str, Any]:
    """Every policy of a multi-agent checkpoint playing its agents; each policy's returns (one per agent
    and episode, as training's per-policy episode returns) and all agents' together."""
    from omegaconf import OmegaConf

    from ppo_fabric.envs.make import EnvError
    from ppo_fabric.envs.multiagent import make_parallel_env, policy_mapping
    from ppo_fabric.policy.game_eval import OPPONENTS, is_aec_game

    env_cfg = OmegaConf.create(state["config"]["env"])
    game = f"env.id={env_cfg.id} is a turn-based game: play it with opponent= ({OPPONENTS})"
    try:
        env = make_parallel_env(env_cfg)
    except EnvError as exc:
        if is_aec_game(str(env_cfg.id)):
            raise EvalError(game) from exc
        raise EvalError(str(exc)) from exc
    if hasattr(env, "agent_iter"):  # an AEC env: its agents take turns
        env.close()
        raise EvalError(game)
    try:
        groups = policy_mapping(list(env.possible_agents), OmegaConf.create(state["config"]["multiagent"]))
    except EnvError as exc:
        env.close()
        raise EvalError(str(exc)) from exc
    start = time.perf_counter()
    try:
        returns, lengths = play_parallel(policies, groups, env, episodes, deterministic, seed)
    finally:
        env.close()
    every = [r for p in returns for r in returns[p]]
    return {
        **_run_summary(checkpoint, env_cfg, state, episodes, deterministic, seed, every, lengths),
        "policies": {
            p: {"agents": groups[p], **_returns_summary(rs), "returns": rs} for p, rs in returns.items()
        },
        "wall_seconds": time.perf_counter() - start,
        "video": None,
    }


def _seats(result: dict[str, Any]) -> str:
    """`(won moving first F, second S)` where the games held both seats."""
    first, second = result["win_rate_moving_first"], result["win_rate_moving_second"]
    return "" if first is None or second is None else f" (won moving first {first:.3f}, second {second:.3f})"


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    """Entry point; exits with status 2 and one line on stderr for bad input."""
    from ppo_fabric.config.arguments import ArgError, fail, parse_key_values

    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(USAGE)
        return None
    try:
        result = evaluate(**parse_key_values(args, SPEC))
    except (ArgError, EvalError) as exc:
        fail(str(exc))
        return None  # unreachable: _fail exits
    mode = "deterministic" if result["deterministic"] else "stochastic"
    if "win_rate" in result:
        print(
            f"ppo-fabric: eval {result['env_id']} ({result['policy']} vs {result['opponent']}, {mode}): "
            f"win {result['win_rate']:.3f} draw {result['draw_rate']:.3f} loss {result['loss_rate']:.3f} "
            f"over {result['games']} games{_seats(result)}; wrote {result['eval_json']}",
            flush=True,
        )
        return result
    if "policies" in result:
        per = ", ".join(f"{p} {r['mean_return']:.2f}" for p, r in result["policies"].items())
        print(
            f"ppo-fabric: eval {result['env_id']}: mean return per policy {per} over {result['episodes']} "
            f"episodes ({mode}); wrote {result['eval_json']}",
            flush=True,
        )
        return result
    print(
        f"ppo-fabric: eval {result['env_id']}: mean return {result['mean_return']:.2f} "
        f"+/- {result['std_return']:.2f} over {result['episodes']} episodes ({mode}); "
        f"wrote {result['eval_json']}" + (f" and {result['video']}" if result["video"] else ""),
        flush=True,
    )
    return result


if __name__ == "__main__":
    main()
