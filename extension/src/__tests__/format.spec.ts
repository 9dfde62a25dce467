import {
  formatBytes,
  formatLoss,
  formatLr,
  formatProgress,
  formatTier,
  progressFraction,
  statusText
} from '../format';
import { session } from './helpers';

describe('formatBytes', () => {
  it.each([
    [0, '0 B'],
    [1023, '1023 B'],
    [1536, '1.50 KiB'],
    [10 * 2 ** 20, '10.0 MiB'],
    [80 * 2 ** 30, '80.0 GiB'],
    [512 * 2 ** 30, '512 GiB'],
    [3 * 2 ** 40, '3.00 TiB']
  ])('%p -> %p', (n, text) => expect(formatBytes(n)).toBe(text));

  it.each([null, undefined, NaN, -1, Infinity])('%p -> dash', n =>
    expect(formatBytes(n as number)).toBe('\u2014')
  );
});

describe('formatTier', () => {
  it('shows used, capacity and percent', () => {
    expect(formatTier({ used_bytes: 2 ** 30, capacity_bytes: 4 * 2 ** 30 })).toBe(
      '1.00 GiB / 4.00 GiB (25%)'
    );
  });
  it('shows only used when capacity is unknown', () => {
    expect(formatTier({ used_bytes: 2 ** 30, capacity_bytes: null })).toBe('1.00 GiB');
  });
  it('is a dash when nothing is known', () => {
    expect(formatTier(undefined)).toBe('\u2014');
    expect(formatTier({ used_bytes: null })).toBe('\u2014');
  });
});

describe('numbers', () => {
  it('formats losses with four significant digits', () => {
    expect(formatLoss(2.34567)).toBe('2.346');
    expect(formatLoss(10)).toBe('10');
    expect(formatLoss(0)).toBe('0');
    expect(formatLoss(1.5e-5)).toBe('1.50e-5');
    expect(formatLoss(null)).toBe('\u2014');
  });
  it('formats learning rates in exponent form', () => {
    expect(formatLr(3e-4)).toBe('3e-4');
    expect(formatLr(0.00025)).toBe('2.5e-4');
    expect(formatLr(1)).toBe('1e0');
    expect(formatLr(1.234567e-3)).toBe('1.23e-3');
    expect(formatLr(undefined)).toBe('\u2014');
  });
  it('formats progress with or without a total', () => {
    expect(formatProgress(12, 100)).toBe('12/100');
    expect(formatProgress(12, null)).toBe('12');
    expect(formatProgress(null, 100)).toBe('\u2014');
    expect(progressFraction(25, 100)).toBe(0.25);
    expect(progressFraction(120, 100)).toBe(1);
    expect(progressFraction(5, null)).toBeNull();
    expect(progressFraction(5, 0)).toBeNull();
  });
});

describe('statusText', () => {
  it('counts running sessions when none is active', () => {
    expect(statusText([], null)).toBe('MegaTrain: 0 running');
    expect(statusText([session(), session({ id: 'b', state: 'paused' })], null)).toBe(
      'MegaTrain: 1 running / 2'
    );
  });
  it("counts this server's runs only (runs from elsewhere have their own group)", () => {
    const away = session({ id: 'e', here: false, state: 'running' });
    expect(statusText([session(), away], null)).toBe('MegaTrain: 1 running');
  });
  it("adds the active notebook's run by name, its step and loss; its state once, when not running", () => {
    const s = session({ state: 'paused' });
    expect(statusText([s], s)).toBe('MegaTrain: 0 running / 1 \u00b7 tiny-gpt paused at step 12/100 \u00b7 loss 2.346');
    const t = session({ loss: null, total_steps: null });
    expect(statusText([t], t)).toBe('MegaTrain: 1 running \u00b7 tiny-gpt step 12');
    expect(statusText([t], t).match(/running/g)).toHaveLength(1);
    const done = session({ state: 'finished', step: 30, total_steps: 30, ended: 3000, loss: 1.5 });
    expect(statusText([done], done)).toBe('MegaTrain: 0 running \u00b7 tiny-gpt finished at step 30/30 \u00b7 loss 1.5');
    const unnamed = session({ name: '', state: 'finished', ended: 3000, loss: null });
    expect(statusText([unnamed], unnamed)).toBe('MegaTrain: 0 running \u00b7 abc123 finished at step 12/100');
  });
});
