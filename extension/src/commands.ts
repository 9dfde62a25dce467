/**
 * Commands the sidebar can send (those megatrain_nb/commands.py marks `sidebar`): validation
 * that mirrors the server's (megatrain_nb/commands.py check_command(sidebar=True)), which controls a
 * state allows, and tracking of a command between the click and the heartbeat that shows its
 * outcome.
 */

import { ILastCommand, ISessionInfo } from './model';

export type CommandName = 'pause' | 'resume' | 'stop' | 'lr';

export interface ICommandRequest {
  command: CommandName;
  value: number | null;
}

export type LrParse = { ok: true; value: number } | { ok: false; error: string };

export const MAX_LR = 10;

/** Parse what the user typed into the learning-rate field. */
export function parseLearningRate(text: string): LrParse {
  const t = text.trim();
  if (t === '') {
    return { ok: false, error: 'Enter a learning rate, e.g. 1e-4' };
  }
  // Number('') is 0 and Number('0x10') is 16: require a plain decimal / exponent literal.
  if (!/^[+]?(\d+\.?\d*|\.\d+)(e[+-]?\d+)?$/i.test(t)) {
    return { ok: false, error: `"${t}" is not a number` };
  }
  const value = Number(t);
  if (!Number.isFinite(value) || value <= 0) {
    return { ok: false, error: 'The learning rate must be greater than 0' };
  }
  if (value > MAX_LR) {
    return { ok: false, error: `A learning rate above ${MAX_LR} is refused` };
  }
  return { ok: true, value };
}

/** Build a request body, or throw for something the server would refuse anyway. */
export function makeCommand(command: CommandName, value: number | null = null): ICommandRequest {
  if (command === 'lr') {
    if (value === null || !Number.isFinite(value) || value <= 0 || value > MAX_LR) {
      throw new Error(`invalid learning rate ${value}`);
    }
    return { command, value };
  }
  if (!['pause', 'resume', 'stop'].includes(command)) {
    throw new Error(`unknown command ${command}`);
  }
  return { command, value: null };
}

export interface IControls {
  pause: boolean;
  resume: boolean;
  stop: boolean;
  lr: boolean;
}

/**
 * The run states in which the sidebar offers each command: the `states` of the one command
 * table (megatrain_nb/commands.py), which tests/lab/test_commands.py checks this against.
 */
export const OFFERED_IN: Record<CommandName, readonly string[]> = {
  pause: ['running'],
  resume: ['paused'],
  stop: ['running', 'paused', 'idle'],
  lr: ['running', 'paused']
};

/** Which controls make sense in a state. */
export function controlsFor(state: string): IControls {
  return {
    pause: OFFERED_IN.pause.includes(state),
    resume: OFFERED_IN.resume.includes(state),
    stop: OFFERED_IN.stop.includes(state),
    lr: OFFERED_IN.lr.includes(state)
  };
}

/** A command sent but not yet confirmed by a heartbeat. */
export interface IPending {
  command: CommandName;
  /** The id the server gave the command (the beacon echoes it in last_command). */
  id: string | null;
  since: number;
}

export const PENDING_LABELS: Record<CommandName, string> = {
  pause: 'pausing\u2026',
  resume: 'resuming\u2026',
  stop: 'stopping\u2026',
  lr: 'setting learning rate\u2026'
};

/** Has this heartbeat caught up with the pending command? Gives the beacon's verdict. */
export function settle(
  pending: IPending,
  session: ISessionInfo,
  now: number,
  timeoutMs = 5000
): { done: boolean; result: ILastCommand | null; timedOut: boolean } {
  const last = session.last_command ?? null;
  if (last && pending.id !== null && last.id === pending.id) {
    return { done: true, result: last, timedOut: false };
  }
  if (now - pending.since > timeoutMs) {
    return { done: true, result: null, timedOut: true };
  }
  return { done: false, result: null, timedOut: false };
}
