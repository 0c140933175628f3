/**
 * `client.schedules`: cron expressions that invoke a function, each due run
 * fired once whatever number of servers share the store. Runs missed while
 * no server ran are not replayed (one found late is recorded `skipped`).
 */

import { seg, type RequestOptions, type Transport } from '../http.js';
import type { CreateScheduleParams, FunctionRun, ScheduleInfo, UpdateScheduleParams } from '../models.js';
import { fromWire, toWire } from '../wire.js';

const path = (id: string, rest = '') => `/v1/schedules/${seg(id)}${rest}`;

export class Schedules {
  constructor(private readonly transport: Transport) {}

  /** A new schedule, with its next run (none while `paused`). */
  async create(params: CreateScheduleParams, options: RequestOptions = {}): Promise<ScheduleInfo> {
    const json = toWire('CreateScheduleBody', params);
    return fromWire<ScheduleInfo>('ScheduleInfo', await this.transport.json({ method: 'POST', path: '/v1/schedules', json }, options));
  }

  /** The workspace's schedules, oldest first. */
  async list(options: RequestOptions = {}): Promise<ScheduleInfo[]> {
    const answer = await this.transport.json<{ items: unknown[] }>({ method: 'GET', path: '/v1/schedules' }, options);
    return fromWire<ScheduleInfo[]>('ScheduleInfo', answer.items);
  }

  /** A schedule, by id or name. */
  async get(id: string, options: RequestOptions = {}): Promise<ScheduleInfo> {
    return fromWire<ScheduleInfo>('ScheduleInfo', await this.transport.json({ method: 'GET', path: path(id) }, options));
  }

  /** Changes its name, cron, time zone, input (`null` removes it) or `paused`. */
  async update(id: string, params: UpdateScheduleParams, options: RequestOptions = {}): Promise<ScheduleInfo> {
    const json = toWire('PatchScheduleBody', params);
    return fromWire<ScheduleInfo>('ScheduleInfo', await this.transport.json({ method: 'PATCH', path: path(id), json }, options));
  }

  /** Stops its runs (it keeps its cron; `nextRunAt` is absent). */
  async pause(id: string, options: RequestOptions = {}): Promise<ScheduleInfo> {
    return this.update(id, { paused: true }, options);
  }

  /** Starts its runs again, the next one computed from now. */
  async resume(id: string, options: RequestOptions = {}): Promise<ScheduleInfo> {
    return this.update(id, { paused: false }, options);
  }

  /**
   * Runs its function now with its input, and resolves with the finished
   * run (`scheduleId` is this schedule's); its cron is unchanged. Not
   * retried: the code may have effects.
   */
  async trigger(id: string, options: RequestOptions = {}): Promise<FunctionRun> {
    return fromWire<FunctionRun>('FunctionRun', await this.transport.json({ method: 'POST', path: path(id, '/trigger') }, options));
  }

  /** The runs it fired, and those it skipped, newest first (`limit` 1 to 1000, 100 by default). */
  async runs(id: string, options: RequestOptions & { limit?: number | undefined } = {}): Promise<FunctionRun[]> {
    const answer = await this.transport.json<{ items: unknown[] }>({ method: 'GET', path: path(id, '/runs'), query: { limit: options.limit } }, options);
    return fromWire<FunctionRun[]>('FunctionRun', answer.items);
  }

  /** Deletes it (its runs stay with its function). */
  async delete(id: string, options: RequestOptions = {}): Promise<void> {
    await this.transport.json({ method: 'DELETE', path: path(id) }, options);
  }
}
