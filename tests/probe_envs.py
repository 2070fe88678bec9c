"""Andy Jones' five probe environments ("Debugging RL, without the agonizing pain").

Each probe isolates one piece of an actor-critic learner, so a failure points at the piece that is broken
instead of at "the agent does not learn CartPole":

1. `ProbeConstant-v0`: value learning at all (V = 1 for the only observation).
2. `ProbeObsDependent-v0`: the critic uses the observation (V(obs) = obs).
3. `ProbeDiscounting-v0`: discounting and bootstrapping across steps (V(first) = gamma, V(second) = 1).
4. `ProbeActionDependent-v0`: the policy gradient with no observation to lean on (pick action 1).
5. `ProbeObsAndAction-v0`: policy and critic together (act on the observation's sign; V = 1).

One continuous-action probe follows them, for the Gaussian head (Box actions):

6. `ProbeContinuousAction-v0`: a uniform observation in [-1, 1], reward -|action - obs / 2|: the policy
   mean must follow a target that depends on the observation, and the critic must learn the (negative)
   value of the remaining exploration noise.

One memory probe follows, for recurrent policies (model=lstm):

7. `ProbeMemory-v0`: memory: only a recurrent policy can carry the cue to the last step. The first
   observation is a random cue of +1 or -1, every later one is 0; after three steps the reward is +1 when
   the last action matches the cue (action 1 for +1, action 0 for -1) and -1 otherwise. A memoryless
   policy sees only 0 when it matters and earns 0 in expectation; a recurrent one can earn 1.

Three action-mask probes follow, one per convention the rollout detects (`algo.action_mask=auto`):

8. `ProbeMaskedObs-v0` (a Dict observation with an `action_mask` key), `ProbeMaskedInfo-v0`
   (`info["action_mask"]`), `ProbeMaskedMethod-v0` (an `action_masks()` method): Discrete(4), two
   actions legal per step. The observation gives 1 for the legal action that pays +1, 0.5 for the other
   legal one (reward 0) and 0 for the illegal ones. An illegal action is counted (`ILLEGAL`, and a line in
   the `illegal_log` file when given, for runs in other processes) and ends the episode with -1; nothing
   is asserted, so runs without masks complete too. Episodes last `LENGTH` steps: the best return is 4.

One pickling probe follows, for resume:

9. `ProbeResetFirst-v0`: pickles as gymnasium's Box2D and MuJoCo envs do (`EzPickle`: rebuilt from its
   constructor arguments, so an unpickled copy was never reset) and, like Box2D, refuses a step before
   `reset`. Episodes last `LENGTH` steps; the reward is 1 for action 1.

Importing this module registers them, so `env.id=tests.probe_envs:ProbeConstant-v0` works: gymnasium (and
ppo_fabric's env builder) imports the module named before the colon. Every episode ends with
`terminated=True`, never `truncated`, so the learner must bootstrap with zero after the last step.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.utils import EzPickle


class _Probe(gym.Env):
    """Shared plumbing: a 1-D float observation in [-1, 1] and seeded randomness for the random probes."""

    def __init__(self, num_actions: int) -> None:
        self.observation_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)
        self.action_space = gym.spaces.Discrete(num_actions)

    @staticmethod
    def _obs(value: float) -> np.ndarray:
        return np.array([value], dtype=np.float32)

    def _random_sign(self) -> float:
        return 1.0 if self.np_random.random() < 0.5 else -1.0


class _SignProbe(_Probe):
    """Episodes start from a random observation of +1 or -1, kept in `_sign`."""

    _sign = 1.0

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self._sign = self._random_sign()
        return self._obs(self._sign), {}


class ProbeConstant(_Probe):
    """One action, observation 0, one step, reward +1: the value of the observation must become 1."""

    def __init__(self) -> None:
        super().__init__(num_actions=1)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        return self._obs(0.0), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        return self._obs(0.0), 1.0, True, False, {}


class ProbeObsDependent(_SignProbe):
    """One action, observation ±1 at random, one step, reward = observation: V(obs) must become obs."""

    def __init__(self) -> None:
        super().__init__(num_actions=1)

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        return self._obs(0.0), self._sign, True, False, {}


class ProbeDiscounting(_Probe):
    """One action, two steps: observation 0 then 1, reward +1 only at the end.

    V(first) must become gamma and V(second) 1: a wrong discount, or bootstrapping from the wrong value,
    shows up as a wrong V(first).
    """

    def __init__(self) -> None:
        super().__init__(num_actions=1)
        self._t = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self._t = 0
        return self._obs(0.0), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        self._t += 1
        if self._t == 1:
            return self._obs(1.0), 0.0, False, False, {}
        return self._obs(0.0), 1.0, True, False, {}


class ProbeActionDependent(_Probe):
    """Two actions, observation 0, one step, reward +1 for action 1 and -1 for action 0.

    The policy must learn to pick action 1, after which V = 1; there is no observation to explain the
    reward, so only the policy gradient can get this right.
    """

    def __init__(self) -> None:
        super().__init__(num_actions=2)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        return self._obs(0.0), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        reward = 1.0 if int(action) == 1 else -1.0
        return self._obs(0.0), reward, True, False, {}


class ProbeObsAndAction(_SignProbe):
    """Two actions, observation ±1 at random, one step, reward +1 when the action matches the sign.

    Action 1 matches +1 and action 0 matches -1 (otherwise the reward is -1). The policy must follow the
    observation, after which V = 1 for both observations: actor and critic must both read the input.
    """

    def __init__(self) -> None:
        super().__init__(num_actions=2)

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        wanted = 1 if self._sign > 0 else 0
        reward = 1.0 if int(action) == wanted else -1.0
        return self._obs(0.0), reward, True, False, {}


class ProbeContinuousAction(gym.Env):
    """Box(-1, 1, (1,)) action, observation uniform in [-1, 1], one step, reward -|action - obs / 2|.

    Continuous actions need their own probe: the discrete probes never touch the Gaussian head (its mean,
    its state-independent log-std, the clipping at the env). The target `TARGET_SCALE * obs` lies in
    [-0.5, 0.5], inside the action bounds, so clipping cannot hide a wrong mean, and it depends on the
    observation, so a constant action cannot score well. The best deterministic action earns 0; a
    Gaussian policy with std s earns -s * sqrt(2 / pi) in expectation (clipping aside), which is what the
    critic must predict for every observation.
    """

    TARGET_SCALE = 0.5

    def __init__(self) -> None:
        self.observation_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)
        self.action_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)
        self._obs = np.zeros(1, dtype=np.float32)

    @classmethod
    def target(cls, observation: float) -> float:
        """The action that earns the best reward (0) for `observation`."""
        return cls.TARGET_SCALE * observation

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self._obs = np.array([self.np_random.uniform(-1.0, 1.0)], dtype=np.float32)
        return self._obs.copy(), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        # The rollout clips to the bounds already; clipping here too keeps the probe right for any caller.
        a = float(np.clip(np.asarray(action, dtype=np.float64).reshape(-1)[0], -1.0, 1.0))
        reward = -abs(a - self.target(float(self._obs[0])))
        return np.zeros(1, dtype=np.float32), reward, True, False, {}


class ProbeMemory(_SignProbe):
    """Two actions, a cue of ±1 at the first step and 0 after it, reward at the last of `LENGTH` steps.

    Rewards are 0 until the last step, which ends the episode (terminated) with +1 when its action matches
    the cue (action 1 for +1, action 0 for -1) and -1 otherwise. The last action sees observation 0, so a
    memoryless policy earns 0 in expectation whatever it does; only a policy that carries the cue in its
    state (an LSTM) can earn 1, and its critic then predicts the discounted +1 at every step.
    """

    LENGTH = 3

    def __init__(self) -> None:
        super().__init__(num_actions=2)
        self._t = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        self._t = 0
        return super().reset(seed=seed, options=options)

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        self._t += 1
        if self._t < self.LENGTH:
            return self._obs(0.0), 0.0, False, False, {}
        wanted = 1 if self._sign > 0 else 0
        reward = 1.0 if int(action) == wanted else -1.0
        return self._obs(0.0), reward, True, False, {}


class _MaskedProbe(gym.Env):
    """Shared by the three action-mask probes: the state, its reward and the illegal-action count."""

    LENGTH = 4
    ILLEGAL = [0]  # illegal actions taken in this process, over every instance (a list: shared, mutable)

    def __init__(self, illegal_log: str | None = None) -> None:
        self.action_space = gym.spaces.Discrete(4)
        self.observation_space = gym.spaces.Box(0.0, 1.0, (4,), np.float32)
        self.illegal_log = illegal_log
        self._t = 0
        self._legal = np.zeros(4, dtype=np.int8)
        self._pays = 0

    def _new_state(self) -> None:
        pair = self.np_random.choice(4, size=2, replace=False)
        self._legal = np.zeros(4, dtype=np.int8)
        self._legal[pair] = 1
        self._pays = int(pair[0])

    def _observation(self) -> np.ndarray:
        obs = 0.5 * self._legal.astype(np.float32)
        obs[self._pays] = 1.0
        return obs

    def _mask(self) -> np.ndarray:
        return self._legal.copy()

    def _reset(self, seed: int | None) -> None:
        super().reset(seed=seed)
        self._t = 0
        self._new_state()

    def _step(self, action: Any) -> tuple[float, bool]:
        """(reward, terminated) of `action`, moving to the next state."""
        a = int(action)
        self._t += 1
        if not self._legal[a]:
            type(self).ILLEGAL[0] += 1
            if self.illegal_log:
                with open(self.illegal_log, "a") as f:
                    f.write(f"{a}\n")
            return -1.0, True
        reward = 1.0 if a == self._pays else 0.0
        self._new_state()
        return reward, self._t >= self.LENGTH


class ProbeMaskedObs(_MaskedProbe):
    """The mask as the `action_mask` key of a Dict observation (PettingZoo's convention)."""

    def __init__(self, illegal_log: str | None = None) -> None:
        super().__init__(illegal_log)
        self.observation_space = gym.spaces.Dict(
            {
                "observation": gym.spaces.Box(0.0, 1.0, (4,), np.float32),
                "action_mask": gym.spaces.Box(0, 1, (4,), np.int8),
            }
        )

    def _full(self) -> dict[str, np.ndarray]:
        return {"observation": self._observation(), "action_mask": self._mask()}

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[dict, dict]:
        self._reset(seed)
        return self._full(), {}

    def step(self, action: Any) -> tuple[dict, float, bool, bool, dict]:
        reward, done = self._step(action)
        return self._full(), reward, done, False, {}


class ProbeMaskedInfo(_MaskedProbe):
    """The mask as `info["action_mask"]` of reset and step."""

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        self._reset(seed)
        return self._observation(), {"action_mask": self._mask()}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        reward, done = self._step(action)
        return self._observation(), reward, done, False, {"action_mask": self._mask()}


class ProbeMaskedMethod(_MaskedProbe):
    """The mask from an `action_masks()` method (sb3-contrib MaskablePPO's convention)."""

    def action_masks(self) -> np.ndarray:
        return self._mask().astype(bool)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        self._reset(seed)
        return self._observation(), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        reward, done = self._step(action)
        return self._observation(), reward, done, False, {}


class ProbeNoLegalAction(ProbeMaskedInfo):
    """Its second state has no legal action: the rollout must stop with an error naming the env."""

    def _mask(self) -> np.ndarray:
        return np.zeros(4, dtype=np.int8) if self._t >= 1 else super()._mask()


class ProbeResetFirst(_Probe, EzPickle):
    """Pickled by its constructor arguments (EzPickle), and a step before `reset` fails, as Box2D's does."""

    LENGTH = 40

    def __init__(self) -> None:
        _Probe.__init__(self, 2)
        EzPickle.__init__(self)
        self._t: int | None = None

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict]:
        super().reset(seed=seed)
        self._t = 0
        return self._obs(0.0), {}

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        assert self._t is not None, "step before reset"
        self._t += 1
        return self._obs(self._t / self.LENGTH), float(action == 1), self._t >= self.LENGTH, False, {}


PROBES: dict[str, type[_Probe]] = {
    "ProbeConstant-v0": ProbeConstant,
    "ProbeObsDependent-v0": ProbeObsDependent,
    "ProbeDiscounting-v0": ProbeDiscounting,
    "ProbeActionDependent-v0": ProbeActionDependent,
    "ProbeObsAndAction-v0": ProbeObsAndAction,
}

# Kept apart from PROBES: those are Andy Jones' five discrete probes, tested together over one API test.
CONTINUOUS_PROBES: dict[str, type[gym.Env]] = {"ProbeContinuousAction-v0": ProbeContinuousAction}
# Also apart: its episodes last ProbeMemory.LENGTH steps, and only a recurrent policy can solve it.
MEMORY_PROBES: dict[str, type[gym.Env]] = {"ProbeMemory-v0": ProbeMemory}
# Also apart: some actions are illegal in each state, and the env reports which by one convention each.
MASKED_PROBES: dict[str, type[gym.Env]] = {
    "ProbeMaskedObs-v0": ProbeMaskedObs,
    "ProbeMaskedInfo-v0": ProbeMaskedInfo,
    "ProbeMaskedMethod-v0": ProbeMaskedMethod,
    "ProbeNoLegalAction-v0": ProbeNoLegalAction,
}

# Also apart: it tests how a run pickles its envs, not learning.
PICKLE_PROBES: dict[str, type[gym.Env]] = {"ProbeResetFirst-v0": ProbeResetFirst}

for _env_id, _cls in {
    **PROBES,
    **CONTINUOUS_PROBES,
    **MEMORY_PROBES,
    **MASKED_PROBES,
    **PICKLE_PROBES,
}.items():
    if _env_id not in gym.registry:  # re-importing (e.g. under another module name) must not warn
        gym.register(id=_env_id, entry_point=f"{__name__}:{_cls.__name__}")
