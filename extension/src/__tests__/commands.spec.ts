import { controlsFor, makeCommand, parseLearningRate, settle } from '../commands';
import { session } from './helpers';

describe('parseLearningRate', () => {
  it.each([
    ['1e-4', 1e-4],
    [' 3E-4 ', 3e-4],
    ['0.001', 0.001],
    ['.5', 0.5],
    ['+2e-5', 2e-5],
    ['10', 10]
  ])('accepts %p', (text, value) => {
    expect(parseLearningRate(text)).toEqual({ ok: true, value });
  });

  it.each([
    ['', 'Enter a learning rate'],
    ['abc', 'not a number'],
    ['0x10', 'not a number'],
    ['1e-4x', 'not a number'],
    ['-1e-4', 'not a number'],
    ['0', 'greater than 0'],
    ['0e5', 'greater than 0'],
    ['11', 'above 10'],
    ['1e999', 'greater than 0']
  ])('refuses %p', (text, message) => {
    const r = parseLearningRate(text);
    expect(r.ok).toBe(false);
    expect(!r.ok && r.error).toContain(message);
  });
});

describe('makeCommand', () => {
  it('builds the request bodies the server accepts', () => {
    expect(makeCommand('pause')).toEqual({ command: 'pause', value: null });
    expect(makeCommand('stop', 5)).toEqual({ command: 'stop', value: null });
    expect(makeCommand('lr', 1e-4)).toEqual({ command: 'lr', value: 1e-4 });
  });
  it('refuses what the server would refuse', () => {
    expect(() => makeCommand('lr', null)).toThrow('invalid learning rate');
    expect(() => makeCommand('lr', -1)).toThrow();
    expect(() => makeCommand('explode' as any)).toThrow('unknown command');
  });
});

describe('controlsFor', () => {
  it('offers pause while running and resume while paused', () => {
    expect(controlsFor('running')).toEqual({ pause: true, resume: false, stop: true, lr: true });
    expect(controlsFor('paused')).toEqual({ pause: false, resume: true, stop: true, lr: true });
  });
  it('offers nothing once the run is over', () => {
    for (const state of ['finished', 'stopped', 'failed']) {
      expect(controlsFor(state)).toEqual({ pause: false, resume: false, stop: false, lr: false });
    }
  });
});

describe('settle', () => {
  const pending = { command: 'pause' as const, id: 'c1', since: 1000 };
  it('waits for the heartbeat that echoes the command id', () => {
    expect(settle(pending, session(), 1500).done).toBe(false);
    const other = session({ last_command: { id: 'c0', ok: true, time: 1 } });
    expect(settle(pending, other, 1500).done).toBe(false);
    const echoed = session({ last_command: { id: 'c1', ok: false, error: 'boom', time: 1 } });
    expect(settle(pending, echoed, 1500)).toEqual({
      done: true,
      result: echoed.last_command,
      timedOut: false
    });
  });
  it('gives up after the timeout', () => {
    expect(settle(pending, session(), 7000)).toEqual({ done: true, result: null, timedOut: true });
  });
});
